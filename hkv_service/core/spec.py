"""A model's cache layout as data: cache groups, their kinds, block sizes and kernel ABIs.

A spec is loaded once (YAML or JSON, or a dict) and validated; every way it can be wrong is a
named :class:`~hkv_service.core.errors.SpecError` with a sentence, never a traceback.

Token geometry. Prompts are hashed in *hash blocks* of ``hash_block_size`` tokens; every group's
``block_size`` is a multiple of it, so group ``g``'s block ``k`` covers tokens
``[k*bs_g, (k+1)*bs_g)`` and is attached to the prefix entry of hash block
``(k+1)*bs_g/hash_block_size - 1`` (the hash that covers its last token). Reuse may only stop
at a multiple of :attr:`CacheSpec.lcm_block_size` (funnel layer 1).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .errors import BadSpecField, SpecError, UnknownKind, WindowSmallerThanBlock, ZeroBlockSize
from .ids import GroupName

__all__ = [
    "DTYPE_BYTES",
    "CacheSpec",
    "GroupKind",
    "GroupSpec",
    "KernelAbi",
    "StatePart",
    "load_spec",
    "spec_from_dict",
]

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "uint8": 1,
}


@functools.lru_cache(maxsize=256)
def _digest(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode())


class GroupKind(enum.StrEnum):
    """What a cache group stores. A COMPRESSED group with an overlap has a TAIL object per
    boundary; a RECURRENT group one state object per boundary the engine kept a state at."""

    COMPRESSED = "COMPRESSED"
    SWA = "SWA"
    INDEXER = "INDEXER"
    RECURRENT = "RECURRENT"


@dataclass(frozen=True, slots=True)
class StatePart:
    """One tensor of a recurrent layer's state (e.g. GDN's conv state, then its SSM state)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class KernelAbi:
    """What a reader's kernel assumes about a block's bytes. Any difference makes it unusable."""

    dtype: str
    layout: str
    block_size: int
    head_shape: tuple[int, ...]
    compression_ratio: int
    kernel_version: str

    def fingerprint(self) -> int:
        """64-bit digest of the ABI; part of every object's key and re-checked on read."""
        text = (
            f"{self.dtype}|{self.layout}|{self.block_size}|"
            f"{','.join(map(str, self.head_shape))}|{self.compression_ratio}|{self.kernel_version}"
        )
        return _digest(text)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    name: GroupName
    kind: GroupKind
    block_size: int  # tokens covered by one block
    abi: KernelAbi
    ratio: int = 1  # tokens per compressed entry (COMPRESSED, INDEXER)
    overlap: int = 0  # extra raw tokens each compressed entry pools from the previous window
    window: int = 0  # SWA window W in tokens
    indexes: GroupName | None = None  # INDEXER: the COMPRESSED group whose entries it indexes
    # RECURRENT: what one layer's state holds (its parts, in the order they are stored), how
    # many layers the group's state object carries, and which recurrence (GDN, MAMBA2, ...);
    # all of it is in the ABI (abi.layout), so a state in another dtype or shape never serves
    state: tuple[StatePart, ...] = ()
    layers: int = 1
    state_kind: str = ""

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.ratio

    @property
    def element_bytes(self) -> int:
        return math.prod(self.abi.head_shape) * DTYPE_BYTES[self.abi.dtype]

    @property
    def bytes_per_block(self) -> int:
        """One block's bytes; a RECURRENT group's object is one state of every layer."""
        if self.kind is GroupKind.RECURRENT:
            return self.layers * sum(p.nbytes for p in self.state)
        return self.entries_per_block * self.element_bytes

    @property
    def tail_tokens_max(self) -> int:
        """Raw tokens a TAIL carries at most at a resume point. Resume points are multiples of
        the LCM block size, hence of ``ratio`` (which divides ``block_size``): no token waits
        uncompressed there, and a tail holds only the ``overlap`` its next pooled entry reads
        (``min(overlap, p)``). A group without overlap has nothing to carry: no TAIL at all."""
        return self.overlap if self.kind is GroupKind.COMPRESSED else 0

    @property
    def tail_bytes(self) -> int:
        return self.tail_tokens_max * self.element_bytes


@dataclass(frozen=True, slots=True)
class CacheSpec:
    model_id: str
    hash_block_size: int
    groups: tuple[GroupSpec, ...]

    @property
    def lcm_block_size(self) -> int:
        return math.lcm(*(g.block_size for g in self.groups))

    def group_index(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if g.name == name:
                return i
        raise KeyError(name)

    def group(self, name: str) -> GroupSpec:
        return self.groups[self.group_index(name)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "hash_block_size": self.hash_block_size,
            "groups": [_group_to_dict(g) for g in self.groups],
        }


def _group_to_dict(g: GroupSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": g.name,
        "kind": g.kind.value,
        "block_size": g.block_size,
        "ratio": g.ratio,
        "overlap": g.overlap,
        "window": g.window,
        "abi": {
            "dtype": g.abi.dtype,
            "layout": g.abi.layout,
            "head_shape": list(g.abi.head_shape),
            "kernel_version": g.abi.kernel_version,
        },
    }
    if g.indexes is not None:
        out["indexes"] = g.indexes
    if g.kind is GroupKind.RECURRENT:
        out["abi"]["layout"] = g.abi.layout.split("|", 1)[0]  # the state is said below
        out.update(state_kind=g.state_kind, layers=g.layers,
                   state=[{"shape": list(p.shape), "dtype": p.dtype} for p in g.state])
    return out


_GROUP_KEYS = {"name", "kind", "block_size", "ratio", "overlap", "window", "indexes", "abi",
               "state", "layers", "state_kind"}
_ABI_KEYS = {"dtype", "layout", "head_shape", "kernel_version"}


def _int_field(raw: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadSpecField(f"{where}: '{key}' must be an integer, got {value!r}")
    if value < 0:
        raise BadSpecField(f"{where}: '{key}' must not be negative, got {value}")
    return value


def _abi_from(raw: Any, where: str, block_size: int, ratio: int) -> KernelAbi:
    if not isinstance(raw, Mapping):
        raise BadSpecField(f"{where}: 'abi' must be a mapping with keys {sorted(_ABI_KEYS)}")
    unknown = set(raw) - _ABI_KEYS
    if unknown:
        raise BadSpecField(f"{where}: unknown abi key(s) {sorted(unknown)}")
    dtype = raw.get("dtype", "float16")
    if dtype not in DTYPE_BYTES:
        raise BadSpecField(f"{where}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    shape = raw.get("head_shape")
    if (
        not isinstance(shape, list | tuple)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise BadSpecField(f"{where}: head_shape must be a non-empty list of positive integers")
    return KernelAbi(
        dtype=dtype,
        layout=str(raw.get("layout", "NHD")),
        block_size=block_size,
        head_shape=tuple(shape),
        compression_ratio=ratio,
        kernel_version=str(raw.get("kernel_version", "1")),
    )


def _group_from(raw: Any, index: int, hash_block: int) -> GroupSpec:
    where = f"group #{index}"
    if not isinstance(raw, Mapping):
        raise BadSpecField(f"{where} must be a mapping")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise BadSpecField(f"{where}: 'name' must be a non-empty string")
    where = f"group {name!r}"
    unknown = set(raw) - _GROUP_KEYS
    if unknown:
        raise BadSpecField(f"{where}: unknown key(s) {sorted(unknown)}")
    try:
        kind = GroupKind(str(raw.get("kind", "")).upper())
    except ValueError:
        raise UnknownKind(
            f"{where}: kind {raw.get('kind')!r} is not one of {[k.value for k in GroupKind]}"
        ) from None
    block_size = _int_field(raw, "block_size", where)
    if block_size == 0:
        raise ZeroBlockSize(f"{where}: block_size must be at least 1 token, got 0")
    if block_size % hash_block:
        raise BadSpecField(
            f"{where}: block_size {block_size} must be a multiple of hash_block_size {hash_block}"
        )
    ratio = _int_field(raw, "ratio", where, 1)
    overlap = _int_field(raw, "overlap", where, 0)
    window = _int_field(raw, "window", where, 0)
    _check_kind_fields(kind, where, block_size, ratio, window)
    indexes = raw.get("indexes")
    if kind is GroupKind.INDEXER and not isinstance(indexes, str):
        raise BadSpecField(f"{where}: an INDEXER group must name the group it 'indexes'")
    abi = _abi_from(raw.get("abi"), where, block_size, ratio)
    state, layers, state_kind = _state_from(raw, kind, where)
    if kind is GroupKind.RECURRENT:  # the state's parts, layers and recurrence are its ABI
        abi = dataclasses.replace(abi, layout=f"{abi.layout}|{state_kind}|{layers}|" + ";".join(
            f"{'x'.join(map(str, p.shape))}:{p.dtype}" for p in state))
    return GroupSpec(
        name=GroupName(name),
        kind=kind,
        block_size=block_size,
        abi=abi,
        ratio=ratio,
        overlap=overlap,
        window=window,
        indexes=GroupName(indexes) if isinstance(indexes, str) else None,
        state=state,
        layers=layers,
        state_kind=state_kind,
    )


def _state_from(raw: Mapping[str, Any], kind: GroupKind, where: str
                ) -> tuple[tuple[StatePart, ...], int, str]:
    """A RECURRENT group's ``state`` (a list of ``{shape, dtype}``, one layer's parts in the
    order they are stored), ``layers`` and ``state_kind``; other kinds take none of them."""
    given = {"state", "layers", "state_kind"} & set(raw)
    if kind is not GroupKind.RECURRENT:
        if given:
            raise BadSpecField(f"{where}: {sorted(given)} belong to a RECURRENT group only")
        return (), 1, ""
    parts_raw = raw.get("state")
    if not isinstance(parts_raw, list) or not parts_raw:
        raise BadSpecField(f"{where}: a RECURRENT group needs 'state': a non-empty list of "
                           "{shape, dtype} (one layer's state tensors, in stored order)")
    parts = []
    for i, p in enumerate(parts_raw):
        if not isinstance(p, Mapping) or set(p) - {"shape", "dtype"}:
            raise BadSpecField(f"{where}: state part #{i} must be a mapping of shape and dtype")
        shape, dtype = p.get("shape"), p.get("dtype")
        if not isinstance(shape, list | tuple) or not shape or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise BadSpecField(f"{where}: state part #{i}'s shape must be a non-empty list of "
                               "positive integers")
        if dtype not in DTYPE_BYTES:
            raise BadSpecField(f"{where}: state part #{i}'s dtype {dtype!r} is not one of "
                               f"{sorted(DTYPE_BYTES)}")
        parts.append(StatePart(tuple(shape), dtype))
    layers = _int_field(raw, "layers", where, 1)
    if layers == 0:
        raise BadSpecField(f"{where}: 'layers' must be at least 1")
    state_kind = raw.get("state_kind", "")
    if not isinstance(state_kind, str) or not state_kind:
        raise BadSpecField(f"{where}: 'state_kind' must name the recurrence (GDN, MAMBA2, ...)")
    return tuple(parts), layers, state_kind


def _check_kind_fields(
    kind: GroupKind, where: str, block_size: int, ratio: int, window: int
) -> None:
    if ratio == 0 or block_size % ratio:
        raise BadSpecField(f"{where}: block_size {block_size} must be a multiple of ratio {ratio}")
    if kind is GroupKind.SWA:
        if window == 0:
            raise BadSpecField(f"{where}: an SWA group needs a window > 0")
        if window < block_size:
            raise WindowSmallerThanBlock(
                f"{where}: window {window} is smaller than its block_size {block_size}; "
                "a block would never be wholly inside the window"
            )


def spec_from_dict(raw: Any) -> CacheSpec:
    if not isinstance(raw, Mapping):
        raise SpecError("a cache spec must be a mapping with model_id, hash_block_size, groups")
    unknown = set(raw) - {"model_id", "hash_block_size", "groups"}
    if unknown:
        raise BadSpecField(f"unknown top-level key(s) {sorted(unknown)}")
    model_id = raw.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise BadSpecField("'model_id' must be a non-empty string")
    hash_block = _int_field(raw, "hash_block_size", "spec")
    if hash_block == 0:
        raise ZeroBlockSize("hash_block_size must be at least 1 token, got 0")
    groups_raw = raw.get("groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise BadSpecField("'groups' must be a non-empty list")
    groups = tuple(_group_from(g, i, hash_block) for i, g in enumerate(groups_raw))
    _check_cross_refs(groups)
    return CacheSpec(model_id=model_id, hash_block_size=hash_block, groups=groups)


def _check_cross_refs(groups: tuple[GroupSpec, ...]) -> None:
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise BadSpecField(f"group names must be unique, got {names}")
    by_name = {g.name: g for g in groups}
    for g in groups:
        if g.indexes is None:
            continue
        target = by_name.get(g.indexes)
        if target is None or target.kind is not GroupKind.COMPRESSED:
            raise BadSpecField(f"group {g.name!r} indexes {g.indexes!r}, not a COMPRESSED group")
        if target.block_size != g.block_size or target.ratio != g.ratio:
            raise BadSpecField(
                f"group {g.name!r} must share block_size and ratio with {g.indexes!r}"
            )


def load_spec(path: str | Path) -> CacheSpec:
    """Load a spec from a .yaml/.yml/.json file. Raises SpecError with the file named."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError(f"cannot read cache spec {p}: {err.strerror}") from None
    try:
        if p.suffix == ".json":
            raw = json.loads(text)
        else:
            import yaml  # a parser, not I/O: the file was read above

            raw = yaml.safe_load(text)
    except ValueError as err:  # json.JSONDecodeError and yaml.YAMLError's common base differs
        raise SpecError(f"{p} is not valid JSON: {err}") from None
    except Exception as err:  # yaml.YAMLError
        raise SpecError(f"{p} is not valid YAML: {str(err).splitlines()[0]}") from None
    try:
        return spec_from_dict(raw)
    except SpecError as err:
        raise type(err)(f"{p}: {err}") from None
