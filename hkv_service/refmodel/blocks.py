"""Cutting a :class:`ModelCache` into the spec's blocks and tails, and putting it back together.

A block of group g is ``entries_per_block`` consecutive rows of that group's tensor (rows are
tokens for swa, entries for c4/c128/idx); block k covers tokens [k*bs, (k+1)*bs):

    swa   (64, 2, dh)   rows = tokens  k*64 .. k*64+63
    c4    (16, 2, dh)   rows = entries k*16 .. k*16+15   (pool tokens [64k-4, 64k+64))
    idx   (16, 1, di)   rows = indexer keys of the same c4 entries
    c128  (1, 2, dh)    row  = entry k                    (pools tokens [128k, 128k+128))

A tail is a COMPRESSED group's raw tokens [tail_start(L), L), exactly its ``count`` rows (at
most :func:`tail_shape`'s), with that count. At a resume point a group without overlap has
none: its tail may be left out.

A recurrent group (layer 3) has no blocks: its object at a resume point L is its state as of
exactly L, the parts (conv state, then recurrent state) flattened and concatenated, float32
``[state_elements]`` (:func:`export_state`; ``block_shape`` says that shape).

Import at L (a multiple of the LCM block size) needs, and validates, exactly what continuing
at L reads: every c4/idx/c128 block before L, the swa blocks meeting [max(0, L - W), L),
both tails with the count L implies, and the recurrent state as of L (none at L = 0).
Anything missing or misshapen is a ValueError that names the group and block; extra blocks
are ignored.

A group's blocks come either one tensor per block (``{k: block}``) or, batched, as a
:class:`BlockRun`: consecutive blocks ``first .. first+n-1`` stacked into one tensor
``[n, *block_shape]``. A run that is exactly the blocks import needs is checked once and becomes
the group's rows with no per-block work and no copy (``import_cache`` keeps it: hand over a run
you will not write to). Any other run is read block by block through its ``Mapping`` face.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from hkv_service.core.spec import GroupSpec

from .cache import CompressedState, ModelCache, empty_state
from .compress import tail_start
from .config import Geometry
from .recurrent import RecurrentState

__all__ = [
    "BlockRun",
    "block_shape",
    "export_block",
    "export_state",
    "export_tail",
    "import_cache",
    "tail_shape",
]

Blocks = Mapping[str, Mapping[int, torch.Tensor]]
Tails = Mapping[str, tuple[torch.Tensor, int]]


class BlockRun(Mapping[int, torch.Tensor]):
    """Blocks ``first .. first + len(stacked) - 1`` of one group, stacked: ``stacked[i]`` is
    block ``first + i``. As a mapping it answers like ``{k: block}`` (views, no copies)."""

    __slots__ = ("first", "stacked")

    def __init__(self, first: int, stacked: torch.Tensor) -> None:
        if stacked.dim() < 1:
            raise ValueError("a block run must stack its blocks along dimension 0")
        self.first = first
        self.stacked = stacked

    def __getitem__(self, k: int) -> torch.Tensor:
        if not self.first <= k < self.first + self.stacked.shape[0]:
            raise KeyError(k)
        return self.stacked[k - self.first]

    def __len__(self) -> int:
        return int(self.stacked.shape[0])

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.first, self.first + len(self)))

    def __repr__(self) -> str:
        return f"BlockRun(first={self.first}, stacked={tuple(self.stacked.shape)})"


def block_shape(geo: Geometry, group: str) -> tuple[int, ...]:
    g = _group(geo, group)
    if g is geo.recurrent:  # one state object: its parts flattened
        return (sum(math.prod(p.shape) for p in g.state),)
    return (g.entries_per_block, *g.abi.head_shape)


def tail_shape(geo: Geometry, group: str) -> tuple[int, ...]:
    g = _group(geo, group)
    if g not in (geo.sparse, geo.heavy):
        raise ValueError(f"group {group!r} is not COMPRESSED and has no tail")
    return (g.ratio - 1 + g.overlap, *g.abi.head_shape)  # the most at any length


def _group(geo: Geometry, group: str) -> GroupSpec:
    try:
        return geo.by_name()[group]
    except KeyError:
        raise ValueError(f"unknown cache group {group!r}; known: {sorted(geo.by_name())}") from None


def _rows_of(cache: ModelCache, geo: Geometry) -> dict[str, tuple[torch.Tensor, int]]:
    """Each group's row tensor and the row number of its first row."""
    keys = cache.sparse.index_keys
    assert keys is not None
    return {
        geo.swa.name: (cache.swa_kv, cache.swa_lo),
        geo.sparse.name: (cache.sparse.entries, 0),
        geo.index.name: (keys, 0),
        geo.heavy.name: (cache.heavy.entries, 0),
    }


def export_block(cache: ModelCache, geo: Geometry, group: str, k: int) -> torch.Tensor:
    g = _group(geo, group)
    if g is geo.recurrent:
        raise ValueError(f"group {group!r} is RECURRENT: it keeps a state, not blocks "
                         "(export_state)")
    if k < 0 or cache.length < (k + 1) * g.block_size:
        raise ValueError(
            f"group {group!r} block {k} covers tokens up to {(k + 1) * g.block_size}, "
            f"but the cache holds {cache.length}"
        )
    rows, first = _rows_of(cache, geo)[group]
    start = k * g.entries_per_block - first
    if start < 0:
        raise ValueError(f"swa block {k} left the window; this cache holds tokens from {first}")
    return rows[start : start + g.entries_per_block].clone()


def _recurrent(cache: ModelCache, geo: Geometry, group: str) -> RecurrentState:
    if _group(geo, group) is not geo.recurrent or cache.recurrent is None:
        raise ValueError(f"group {group!r} is not RECURRENT and keeps no state")
    return cache.recurrent


def state_parts(cache: ModelCache, geo: Geometry, group: str) -> tuple[torch.Tensor, ...]:
    st = _recurrent(cache, geo, group)
    return (st.conv.clone(), st.ssm.clone())


def export_state(cache: ModelCache, geo: Geometry, group: str) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in state_parts(cache, geo, group)])


def _state(states: Mapping[str, torch.Tensor] | None, geo: Geometry, length: int,
           device: torch.device) -> RecurrentState | None:
    g = geo.recurrent
    if g is None or length == 0:  # nothing before token 0: the zero state
        return empty_state(geo, device)
    flat = (states or {}).get(g.name)
    what = f"the state of group {g.name!r} at length {length}"
    flat = _checked(flat, what, block_shape(geo, g.name)).to(device)
    conv_shape, ssm_shape = (p.shape for p in g.state)
    n = math.prod(conv_shape)
    return RecurrentState(flat[:n].reshape(conv_shape).clone(), flat[n:].reshape(ssm_shape).clone())


def export_tail(cache: ModelCache, geo: Geometry, group: str) -> tuple[torch.Tensor, int]:
    tail_shape(geo, group)  # names a group without a tail
    tail = (cache.sparse if group == geo.sparse.name else cache.heavy).tail
    return tail.clone(), tail.shape[0]


def _checked(t: torch.Tensor | None, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    if t is None:
        raise ValueError(f"{what} is missing")
    if tuple(t.shape) != shape or t.dtype != torch.float32:
        raise ValueError(f"{what} must be float32 {shape}, got {t.dtype} {tuple(t.shape)}")
    return t


def _gather(
    blocks: Blocks, geo: Geometry, group: str, ks: range, device: torch.device
) -> torch.Tensor:
    shape = block_shape(geo, group)
    have = blocks.get(group, {})
    if (
        isinstance(have, BlockRun) and ks and have.first == ks.start and len(have) == len(ks)
        and tuple(have.stacked.shape[1:]) == shape and have.stacked.dtype == torch.float32
    ):  # batched: exactly the blocks needed, in order; one check, one view
        return have.stacked.reshape(len(ks) * shape[0], *shape[1:]).to(device)
    rows = [_checked(have.get(k), f"group {group!r} block {k}", shape).to(device) for k in ks]
    return torch.cat(rows) if rows else torch.zeros((0, *shape[1:]), device=device)


def _tail(
    tails: Tails, geo: Geometry, group: str, length: int, device: torch.device
) -> torch.Tensor:
    g = _group(geo, group)
    want = length - tail_start(length, g.ratio, g.overlap)
    if group not in tails:
        if want == 0:  # nothing to carry: no tail object exists for it
            return torch.zeros((0, *g.abi.head_shape), dtype=torch.float32, device=device)
        raise ValueError(f"the tail of group {group!r} at length {length} is missing")
    tensor, count = tails[group]
    if count != want:
        raise ValueError(
            f"the tail of group {group!r} at length {length} must hold {want} tokens, got {count}"
        )
    tensor = _checked(tensor, f"the tail of group {group!r}", (count, *g.abi.head_shape))
    return tensor.to(device)


def import_cache(
    geo: Geometry, length: int, blocks: Blocks, tails: Tails, device: torch.device,
    states: Mapping[str, torch.Tensor] | None = None,
) -> ModelCache:
    if length < 0 or length % geo.chunk:
        raise ValueError(f"import length {length} must be a non-negative multiple of {geo.chunk}")
    whole = {g.name: range(length // g.block_size) for g in (geo.sparse, geo.heavy, geo.index)}
    bs = geo.swa.block_size
    swa_ks = range(max(0, length - geo.swa.window) // bs, length // bs)
    sparse = CompressedState(
        _gather(blocks, geo, geo.sparse.name, whole[geo.sparse.name], device),
        _tail(tails, geo, geo.sparse.name, length, device),
        _gather(blocks, geo, geo.index.name, whole[geo.index.name], device),
    )
    heavy = CompressedState(
        _gather(blocks, geo, geo.heavy.name, whole[geo.heavy.name], device),
        _tail(tails, geo, geo.heavy.name, length, device),
    )
    swa_kv = _gather(blocks, geo, geo.swa.name, swa_ks, device)
    state = _state(states, geo, length, device)
    return ModelCache(length, swa_ks.start * bs, swa_kv, sparse, heavy, recurrent=state)
