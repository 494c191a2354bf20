"""The model's cached state after ``length`` tokens: what each layer needs to continue.

A :class:`ModelCache` is immutable: ``extend`` returns a new one and never writes into the
tensors of the one it was given, so a cache (or a block exported from it) stays valid after any
later call. All tensors are float32 on the model's device, row-major by token or entry:

    swa_kv              raw K|V of layer 0 for tokens [swa_lo, length)      [length-swa_lo, 2, dh]
    sparse.entries      c4 entries 0 .. length//4 - 1                        [length//4, 2, dh]
    sparse.index_keys   one indexer key per c4 entry                         [length//4, 1, di]
    sparse.tail         raw K|V of layer 1 for tokens [tail_start, length)   [<= 7, 2, dh]
    heavy.entries       c128 entries 0 .. length//128 - 1                    [length//128, 2, dh]
    heavy.tail          raw K|V of layer 2 for tokens [tail_start, length)   [<= 127, 2, dh]

    recurrent.conv      layer 3's conv state: its last K-1 inputs             [K-1, dk+dv]
    recurrent.ssm       layer 3's recurrent state as of ``length``            [dk, dv]

(``tail_start`` is defined in :mod:`.compress`; ``recurrent`` exists only when the spec has a
RECURRENT group, see :mod:`.recurrent`.) A cache built by ``prefill`` keeps the whole
sliding-window history (``swa_lo == 0``) so every block can be exported; an imported cache
holds only the window the next token needs (``swa_lo <= max(0, length - window)``).
``last_logits`` are the logits of token ``length - 1``; an imported cache has none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compress import tail_start
from .config import Geometry
from .recurrent import RecurrentState

__all__ = ["CompressedState", "ModelCache", "check_integrity", "empty_cache", "empty_state"]


@dataclass(frozen=True)
class CompressedState:
    entries: torch.Tensor  # [length // ratio, 2, dh]
    tail: torch.Tensor  # [length - tail_start(length), 2, dh]
    index_keys: torch.Tensor | None = None  # [length // ratio, 1, di] for the indexed group


@dataclass(frozen=True)
class ModelCache:
    length: int
    swa_lo: int
    swa_kv: torch.Tensor
    sparse: CompressedState
    heavy: CompressedState
    last_logits: torch.Tensor | None = None
    recurrent: RecurrentState | None = None  # layer 3's state as of ``length``


def _rows(n: int, geo: Geometry, device: torch.device, width: int = 2) -> torch.Tensor:
    dim = geo.index_dim if width == 1 else geo.head_dim
    return torch.zeros((n, width, dim), dtype=torch.float32, device=device)


def empty_cache(geo: Geometry, device: torch.device) -> ModelCache:
    return ModelCache(
        length=0,
        swa_lo=0,
        swa_kv=_rows(0, geo, device),
        sparse=CompressedState(
            _rows(0, geo, device), _rows(0, geo, device), _rows(0, geo, device, 1)
        ),
        heavy=CompressedState(_rows(0, geo, device), _rows(0, geo, device)),
        recurrent=empty_state(geo, device),
    )


def empty_state(geo: Geometry, device: torch.device) -> RecurrentState | None:
    """Layer 3's state before token 0 (zeros), or None without a recurrent layer."""
    if geo.recurrent is None:
        return None
    dk, dv = geo.key_dim, geo.value_dim
    return RecurrentState(
        torch.zeros((geo.conv_kernel - 1, dk + dv), dtype=torch.float32, device=device),
        torch.zeros((dk, dv), dtype=torch.float32, device=device),
    )


def check_integrity(cache: ModelCache, geo: Geometry) -> None:
    """Assert every tensor has the row count its length implies (our invariant, not input)."""
    n = cache.length
    assert 0 <= cache.swa_lo <= max(0, n - geo.swa.window), "swa window not held"
    assert cache.swa_kv.shape[0] == n - cache.swa_lo
    for state, g in ((cache.sparse, geo.sparse), (cache.heavy, geo.heavy)):
        assert state.entries.shape[0] == n // g.ratio
        assert state.tail.shape[0] == n - tail_start(n, g.ratio, g.overlap)
    keys = cache.sparse.index_keys
    assert keys is not None and keys.shape[0] == n // geo.sparse.ratio
    assert (cache.recurrent is None) == (geo.recurrent is None)
