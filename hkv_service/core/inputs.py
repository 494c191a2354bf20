"""What a caller sends, checked before anything changes: the one home of each such rule.

Every check raises a core error (``InvalidInput``, ``BadHash``, ``UnknownGroup`` ...) and
touches no state, so a path runs them all first and a refused call leaves the view as it
was. The server's own request checks call these too (a pool's bounds, a lease's TTL): the
limits are written once, here.
"""

from __future__ import annotations

from collections.abc import Sequence

from .allocator import PoolConfig
from .api import AllocRequest, ObjectReport, ObjectTransitions
from .contracts import READY_STATES
from .errors import (
    BadHash,
    FutureGeneration,
    InvalidInput,
    StaleHandle,
    UnknownGroup,
    UnsetVersion,
    WrongPartition,
)
from .ids import BLOCK_HASH_BYTES, BlockHash
from .layout import Layout
from .partitions import Partition, partition_of_root
from .records import ObjRecord
from .states import Event, Kind, State
from .transitions import CORE_ONLY_EVENTS, Params

__all__ = [
    "MAX_GENERATION_FLOOR",
    "MAX_POOL_BLOCKS",
    "check_generation",
    "check_hashes",
    "check_item",
    "check_pool",
    "check_range",
    "check_report",
    "check_reported",
    "check_root",
    "check_slot",
    "check_version",
    "column_of",
    "lease_ttl_exceeded",
    "params_at",
]

MAX_POOL_BLOCKS = 1 << 24  # the metadata twin of a pool costs ~3 words per block
# Generations live in int64 fields (shard pools, handle batches): a floor this far below
# 2**63 leaves 2**62 frees of a block before one would overflow.
MAX_GENERATION_FLOOR = 1 << 62
# Enum members on a re-confirm's per-report path, read once: through their class each read
# costs ~0.1 us in Python 3.11 (EnumType.__getattr__ puts every class attribute read on the
# slow path), ~10x a module global.
_ON_DISK = State.ON_DISK
_TAIL, _SWA = Kind.TAIL, Kind.SWA
_VERSIONED = frozenset({Kind.COMPRESSED, Kind.INDEXER})
_READABLE = READY_STATES


def column_of(layout: Layout, name: str) -> int:
    col = layout.by_name.get(name)
    if col is None:
        raise UnknownGroup(f"unknown group {name!r}; the spec has {sorted(layout.by_name)}")
    return col


def check_hashes(hashes: Sequence[BlockHash]) -> None:
    if not hashes:
        raise BadHash("no block hashes given; a prefix needs at least one")
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != BLOCK_HASH_BYTES:
            raise BadHash(f"block hash must be {BLOCK_HASH_BYTES} bytes, got {len(h)}")


def check_root(part: Partition, hashes: Sequence[BlockHash]) -> None:
    """A partitioned view holds only the chains whose root routes to it."""
    if not part.whole and hashes and not part.owns_root(hashes[0]):
        expected = partition_of_root(hashes[0], part.count)
        raise WrongPartition(
            f"this metadata partition is {part}; the chain's root belongs to partition "
            f"{expected}: give every client the partitions in the deployment's order",
            partition=str(part), expected=expected)


def check_range(range_blocks: int, first: int, nhashes: int, what: str) -> None:
    """A request's hashes start at a range's first block and stay inside that range
    (StateConfig.range_blocks): a range lives whole in one partition."""
    r = range_blocks
    if first < 0:
        raise InvalidInput(f"first_block must be >= 0, got {first}")
    if not r:
        if first:
            raise InvalidInput(
                f"{what} from block {first}: this service keeps a chain whole "
                "(range_blocks 0); send the hashes from block 0")
        return
    if first % r or nhashes > r:
        raise InvalidInput(
            f"{what} of {nhashes} hashes from block {first}: this service splits chains "
            f"every {r} blocks, so a request covers one range [kR, (k+1)R); the "
            "partitioned client (workers.partitioned) splits them")


def check_slot(layout: Layout, r: AllocRequest, nhashes: int, first: int = 0) -> None:
    col = column_of(layout, r.column)
    if not first <= r.depth < first + nhashes:
        raise InvalidInput(f"depth {r.depth} is outside the {nhashes} hashes given"
                           + (f" from block {first}" if first else ""))
    if not layout.lives_at(col, r.depth):
        raise InvalidInput(
            f"column {r.column!r} has no block ending at hash block {r.depth} "
            f"(its blocks end every {layout.columns[col].group.block_size} tokens)"
        )


def check_generation(rec: ObjRecord, generation: int) -> None:
    if generation > rec.generation:
        raise FutureGeneration(
            f"generation {generation} of object {rec.object_id} was never issued "
            f"(current {rec.generation})"
        )
    if generation < rec.generation:
        raise StaleHandle(f"generation {generation} of object {rec.object_id} is stale")


def check_version(p: Params, object_id: int) -> None:
    if p.version is not None and p.version < 1:
        raise UnsetVersion(f"version {p.version} for object {object_id}: a KV version "
                           "is at least 1 (0 is an unset field)")


def check_pool(name: str, cfg: PoolConfig) -> PoolConfig:
    """A pool an owner registers: one the view can keep books for."""
    if not 1 <= cfg.num_blocks <= MAX_POOL_BLOCKS:
        raise InvalidInput(f"pool {name!r}: num_blocks must be in [1, {MAX_POOL_BLOCKS}], "
                           f"got {cfg.num_blocks}")
    if not 0 <= cfg.first < cfg.num_blocks:
        raise InvalidInput(f"pool {name!r}: first block {cfg.first} must be in [0, num_blocks)")
    if cfg.stride < 1 or cfg.base_align < 1 or cfg.base_align & (cfg.base_align - 1):
        raise InvalidInput(f"pool {name!r}: stride >= 1 and a power-of-two base_align needed")
    if not 0 <= cfg.generation_floor < MAX_GENERATION_FLOOR:
        raise InvalidInput(f"pool {name!r}: generation_floor must be in [0, 2**62), got "
                           f"{cfg.generation_floor}")
    return cfg


def lease_ttl_exceeded(ttl_s: float, max_ttl_s: float, where: str = "") -> InvalidInput:
    """The refusal of a lease longer than the view grants (``StateConfig.max_lease_ttl_s``);
    callers compare inline, on the lookup's path."""
    return InvalidInput(f"{where}lease_ttl_s {ttl_s} exceeds the maximum {max_ttl_s}")


def check_item(i: int, item: ObjectTransitions) -> None:
    if not item.events:
        raise InvalidInput(f"item {i}: no events; an item reports at least one event of its "
                           "object")
    if len(item.params) > len(item.events):
        raise InvalidInput(f"item {i}: {len(item.params)} params for {len(item.events)} "
                           "event(s); params[j] goes with events[j]")
    for event in item.events:
        check_reported(event, f"item {i}: ")


def check_reported(event: Event, where: str = "") -> None:
    """Refuse an event only the core's own paths cause (:data:`CORE_ONLY_EVENTS`)."""
    if event in CORE_ONLY_EVENTS:
        raise InvalidInput(f"{where}{event.value} is not reported: begin_load and "
                           "begin_offload cause it, with the block and admission they reserve")


def params_at(item: ObjectTransitions, k: int) -> Params | None:
    return item.params[k] if k < len(item.params) else None


def check_report(layout: Layout, r: ObjectReport, col: int | None = None) -> None:
    """Raise unless ``r`` is a report a confirm takes (the one home of that rule: an owner
    filters what it vouches for with it). A vouched state must be one its column's kind can
    be read in (else no transition, not even LOSE, applies to the record), an SWA range must
    lie inside its block, and a complete tail must hold exactly the raw tokens its boundary
    needs (as TAIL_DONE demands: a tail vouched for with another length would be read as
    whole). ``col``: the column of ``r.column``, where the caller found it already."""
    if col is None:
        col = layout.by_name.get(r.column)
    if col is None:
        raise UnknownGroup(f"unknown group {r.column!r}; the spec has {sorted(layout.by_name)}")
    column = layout.columns[col]
    kind = column.kind
    if r.state is not _ON_DISK and r.state not in _READABLE[kind]:
        raise InvalidInput(f"report for {column.name!r} at depth {r.depth}: "
                           f"{r.state.value} is not a state of a {column.kind.value} object")
    if kind in _VERSIONED and r.version < 1:
        # an unset proto field reads 0: a KV or indexer vouched for at "version 0" could
        # pair with any other unset one
        raise UnsetVersion(f"report for {column.name!r} at depth {r.depth}: version "
                           f"{r.version}; a KV version is at least 1")
    if kind is _SWA:
        start, end = layout.block_range(col, r.depth)
        if not start <= r.lo <= r.hi <= end:
            raise InvalidInput(f"SWA report at depth {r.depth}: range [{r.lo}, {r.hi}) "
                               f"must lie inside its block [{start}, {end})")
    elif kind is _TAIL:
        need = layout.tail_tokens(col, r.depth)
        if r.hi != need:
            raise InvalidInput(f"tail report for {column.name!r} at depth {r.depth}: "
                               f"{r.hi} raw tokens, its boundary needs exactly {need}")
