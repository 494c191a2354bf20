"""Runtime records of the state view: objects, prefix entries and the handles given out.

State (metadata, here) and data (bytes in a shard's block pool) are joined by one handle,
``(object id, generation, location)``. A record is mutable but only
:func:`hkv_service.core.transitions.apply` moves its ``state`` (:func:`set_state`).

Column layout of a prefix entry (one entry per hash block)::

    columns = [ group 0 | group 1 | ... | group G-1 | tail of compressed group a | tail of b ... ]
              `---------- one per spec group -------'`---- one per COMPRESSED group ----------'
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import InitVar, dataclass, field, replace
from typing import Any, ClassVar, Protocol, cast

import numpy as np
import numpy.typing as npt

from .ids import BlockHash, GroupName, ObjectId, ShardId
from .states import Kind, State

__all__ = [
    "HANDLE_DTYPE",
    "NO_CHILD",
    "Dependent",
    "DiskRecord",
    "Handle",
    "HandleColumn",
    "NoChild",
    "ObjRecord",
    "PackedRun",
    "PrefixEntry",
    "Segment",
    "StateRecord",
    "SwaRecord",
    "TailRecord",
    "VersionedRecord",
    "drop_memos",
    "entry_type",
    "mem_at",
    "new_record",
    "record_type",
    "register",
    "set_mem",
    "set_shard",
    "set_state",
]


@dataclass(frozen=True, slots=True)
class Handle:
    """What a reader needs to fetch bytes: valid only while ``generation`` is current."""

    object_id: ObjectId
    generation: int
    shard: ShardId
    column: int  # column index (see module docstring)
    block: int  # block index in the shard's pool for that column
    kind: Kind
    group: GroupName
    nbytes: int
    abi_fingerprint: int
    address: int  # byte offset of the block inside its pool (layer 4 checks it)

    def __reduce__(self) -> tuple[type[Handle], tuple[object, ...]]:
        # A plain tuple pickles ~4x faster than the dataclass default: handles cross Ray
        # by the thousand on every read.
        return (Handle, (self.object_id, self.generation, self.shard, self.column, self.block,
                         self.kind, self.group, self.nbytes, self.abi_fingerprint, self.address))


HANDLE_DTYPE = np.dtype(
    [("object_id", "<u8"), ("generation", "<u8"), ("block", "<i4"), ("shard", "<u2")]
)
"""One handle as a packed little-endian record (22 bytes): what a lookup hands out per object,
in memory and on the wire. ``shard`` indexes the column's ``shard_names``."""
_SHARD_AT: int = HANDLE_DTYPE.fields["shard"][1]  # type: ignore[index]  # its byte offset


@dataclass(frozen=True, slots=True)
class HandleColumn:
    """The handles of one column as packed :data:`HANDLE_DTYPE` records: a snapshot taken
    under the state view's lock. Packing is the point: a 2,048-block match has ~5k handles,
    and the lookup path never builds a Python object per handle (the state view joins
    per-entry rows; the server copies the bytes into the reply). The per-handle tuples and
    :class:`Handle` objects are materialised only for a caller that asks."""

    column: int
    name: GroupName
    kind: Kind
    nbytes: int
    abi_fingerprint: int
    records: bytes  # n * HANDLE_DTYPE.itemsize bytes
    shard_names: tuple[ShardId, ...]  # record.shard -> shard name
    strides: tuple[int, ...]  # record.shard -> block stride in that shard's pool (0: none)

    def check(self) -> HandleColumn:
        """Raise ValueError unless the records are well-formed; for columns that arrive from
        outside (the wire). The state view builds well-formed ones and skips this."""
        if len(self.records) % HANDLE_DTYPE.itemsize:
            raise ValueError(f"handle records of {self.name!r} are not whole "
                             f"{HANDLE_DTYPE.itemsize}-byte records")
        if len(self.strides) != len(self.shard_names):
            raise ValueError("one stride per shard name is required")
        if len(self) and int(self.array["shard"].max()) >= len(self.shard_names):
            raise ValueError(f"a handle of {self.name!r} names a shard outside the table")
        return self

    @classmethod
    def pack(
        cls, column: int, name: GroupName, kind: Kind, nbytes: int, abi_fingerprint: int,
        object_ids: Sequence[int], generations: Sequence[int], shards: Sequence[int],
        blocks: Sequence[int], shard_names: tuple[ShardId, ...], strides: tuple[int, ...],
    ) -> HandleColumn:
        """From parallel arrays (``shards`` as indexes into ``shard_names``)."""
        arr = np.zeros(len(object_ids), HANDLE_DTYPE)
        arr["object_id"], arr["generation"] = object_ids, generations
        arr["block"], arr["shard"] = blocks, shards
        return cls(column, name, kind, nbytes, abi_fingerprint, arr.tobytes(), shard_names,
                   strides)

    @classmethod
    def concat(cls, pieces: Sequence[HandleColumn]) -> HandleColumn:
        """One column of ``pieces`` (of the same column, in token order) joined: the ranges
        of a chain split across partitions, each with its own shard-name table, become one
        column over the union of their tables (a shard's stride: the first piece's)."""
        first = pieces[0]
        if any(p.column != first.column for p in pieces):
            raise ValueError(f"columns {sorted({p.column for p in pieces})} do not join")
        if all(p.shard_names == first.shard_names and p.strides == first.strides
               for p in pieces):  # one table (the partitions met the shards in one order)
            return replace(first, records=b"".join(p.records for p in pieces))
        names: dict[ShardId, int] = {}
        strides: list[int] = []
        out = bytearray()
        for piece in pieces:
            remap = np.empty(len(piece.shard_names), np.uint16)
            for i, (name, stride) in enumerate(zip(piece.shard_names, piece.strides,
                                                   strict=True)):
                j = names.get(name)
                if j is None:
                    j = names[name] = len(strides)
                    strides.append(stride)
                remap[i] = j
            rows = np.frombuffer(piece.records, np.uint8).reshape(-1, HANDLE_DTYPE.itemsize)
            shard = rows[:, _SHARD_AT:_SHARD_AT + 2].copy().view("<u2")  # each record's ordinal
            rows = rows.copy()
            rows[:, _SHARD_AT:_SHARD_AT + 2] = remap[shard].astype("<u2").view(np.uint8)
            out += rows.tobytes()
        return cls(first.column, first.name, first.kind, first.nbytes, first.abi_fingerprint,
                   bytes(out), tuple(names), tuple(strides))

    @property
    def array(self) -> npt.NDArray[np.void]:
        return np.frombuffer(self.records, HANDLE_DTYPE)

    def __len__(self) -> int:
        return len(self.records) // HANDLE_DTYPE.itemsize

    @property
    def object_ids(self) -> tuple[int, ...]:
        return tuple(self.array["object_id"].tolist())

    @property
    def generations(self) -> tuple[int, ...]:
        return tuple(self.array["generation"].tolist())

    @property
    def blocks(self) -> tuple[int, ...]:  # -1: a DISK copy at rest, to be loaded first
        return tuple(self.array["block"].tolist())

    @property
    def shards(self) -> tuple[ShardId, ...]:
        return tuple(map(self.shard_names.__getitem__, self.array["shard"].tolist()))

    @property
    def addresses(self) -> tuple[int, ...]:
        """Byte offset of each block in its pool (layer 4 checked its alignment)."""
        arr = self.array
        stride = np.asarray(self.strides, dtype=np.int64)[arr["shard"].astype(np.int64)]
        return tuple(np.where(arr["block"] >= 0, arr["block"] * stride, 0).tolist())

    def handles(self) -> tuple[Handle, ...]:
        c, k, g, n, a = self.column, self.kind, self.name, self.nbytes, self.abi_fingerprint
        return tuple(
            Handle(ObjectId(o), gen, sh, c, blk, k, g, n, a, addr)
            for o, gen, sh, blk, addr in zip(
                self.object_ids, self.generations, self.shards, self.blocks, self.addresses,
                strict=True,
            )
        )


@dataclass(slots=True, eq=False)
class ObjRecord:
    """One cache object; build it with :func:`new_record`.

    Memory is the budget here (one record per block per column, millions per service), so a
    record carries only what is its own: ``kind``, ``column``, ``shard`` and ``state`` are
    class attributes of a small class per (kind, column, shard, state) (see
    :func:`record_type`; a record whose state or shard moves changes class:
    :func:`set_state`, :func:`set_shard`), each kind's class adds only the
    fields that kind uses (``version``, ``lo``/``hi``), the other fields read the class
    defaults below, and leases/captures are counted beside the records (``checks.Holds``).
    The handle's byte alignment is derived from the owner's pool when needed.
    """

    object_id: ObjectId
    entry: PrefixEntry
    block: int  # -1 when no memory block backs it
    generation: int
    seq: int = 0  # transitions applied; compare-and-set token
    kind: ClassVar[Kind]
    column: ClassVar[int]
    # owner of the bytes ("" while a DISK object has no memory copy); one class per owner,
    # so a record stores no 8-byte pointer to a name millions of records share
    shard: ClassVar[ShardId]
    state: ClassVar[State]  # (its class's: set_state moves it)
    # the classes of this (kind, column, shard) in other states, as set_state meets them
    _moved: ClassVar[dict[State, type[ObjRecord]]]
    # Kind-specific fields: the class defaults answer for kinds that do not store them;
    # assigning one on such a record raises AttributeError (no silent write).
    version: ClassVar[int] = 0  # COMPRESSED: KV version; INDEXER: version synced to
    lo: ClassVar[int] = 0  # SWA: valid tokens [lo, hi)
    hi: ClassVar[int] = 0  # SWA: end of the valid range; TAIL: raw tokens held
    inner: ClassVar[Kind | None] = None  # DISK: kind of the memory object it copies
    disk_owner: ClassVar[ShardId | None] = None  # DISK: the tier holding the copy


@dataclass(slots=True, eq=False)
class VersionedRecord(ObjRecord):
    version: int = 0  # type: ignore[misc]


@dataclass(slots=True, eq=False)
class SwaRecord(ObjRecord):
    lo: int = 0  # type: ignore[misc]
    hi: int = 0  # type: ignore[misc]


@dataclass(slots=True, eq=False)
class TailRecord(ObjRecord):
    hi: int = 0  # type: ignore[misc]


@dataclass(slots=True, eq=False)
class StateRecord(ObjRecord):
    """A recurrent state as of its boundary: the entry it lives at says which; nothing
    moves but its state."""


@dataclass(slots=True, eq=False)
class DiskRecord(ObjRecord):
    """A DISK object: a copy of a memory object in an owner's disk tier."""

    version: int = 0  # type: ignore[misc]
    lo: int = 0  # type: ignore[misc]
    hi: int = 0  # type: ignore[misc]
    inner: Kind | None = None  # type: ignore[misc]
    disk_owner: ShardId | None = None  # type: ignore[misc]


_KIND_BASE: dict[Kind, type[ObjRecord]] = {
    Kind.COMPRESSED: VersionedRecord,
    Kind.INDEXER: VersionedRecord,
    Kind.SWA: SwaRecord,
    Kind.TAIL: TailRecord,
    Kind.STATE: StateRecord,
    Kind.DISK: DiskRecord,
}


@functools.cache
def record_type(kind: Kind, column: int, shard: ShardId, state: State) -> type[ObjRecord]:
    """The record class of one (kind, column, shard, state): no slots of its own, four class
    attributes. Every class of a kind has the same slots, so a record moves between them
    (:func:`set_state`, :func:`set_shard`): a few dozen classes per owner, where each of
    millions of records stored two pointers."""
    base = _KIND_BASE[kind]
    name = f"{base.__name__}_{kind.name.lower()}_{column}"
    return type(name, (base,), {"__slots__": (), "kind": kind, "column": column,
                                "shard": shard, "state": state, "_moved": {}})


# (kind, column, shard, state) -> record class, filled by new_record: a plain dict read is
# ~2x cheaper than record_type's cache, and a re-confirm makes a record per report
_TYPES: dict[tuple[Kind, int, ShardId, State],
             tuple[Callable[..., ObjRecord], type[ObjRecord]]] = {}


def _record_class(kind: Kind, column: int, shard: ShardId, state: State
                  ) -> tuple[Callable[..., ObjRecord], type[ObjRecord]]:
    key = (kind, column, shard, state)
    got = _TYPES.get(key)
    if got is None:
        got = _TYPES[key] = (record_type(kind, column, shard, state), _KIND_BASE[kind])
    return got


def set_state(rec: ObjRecord, state: State) -> None:
    """``rec`` is in ``state`` from now on (only ``transitions.apply`` moves a state, and a
    rehearsal puts one back)."""
    cls = type(rec)
    to = cls._moved.get(state)
    if to is None:
        to = cls._moved[state] = record_type(cls.kind, cls.column, cls.shard, state)
    rec.__class__ = to


def set_shard(rec: ObjRecord, shard: ShardId) -> None:
    """``rec``'s bytes are on ``shard`` from now on (its class says whose they are)."""
    rec.__class__ = record_type(rec.kind, rec.column, shard, rec.state)


def new_record(
    kind: Kind, column: int, object_id: ObjectId, entry: PrefixEntry, state: State,
    shard: ShardId, block: int, generation: int, *, version: int = 0, lo: int = 0,
    hi: int = 0, inner: Kind | None = None, disk_owner: ShardId | None = None,
) -> ObjRecord:
    """A record of ``kind`` in ``column`` on ``shard``; the fields the kind does not store
    (``lo`` of a COMPRESSED object, say) are dropped: they mean nothing for it. (Positional
    arguments, in each class's field order: ~4x cheaper than keywords filtered by name.)"""
    got = _TYPES.get((kind, column, shard, state))  # (inlined _record_class: per report)
    make, base = got if got is not None else _record_class(kind, column, shard, state)
    if base is VersionedRecord:
        return make(object_id, entry, block, generation, 0, version)
    if base is SwaRecord:
        return make(object_id, entry, block, generation, 0, lo, hi)
    if base is TailRecord:
        return make(object_id, entry, block, generation, 0, hi)
    if base is StateRecord:
        return make(object_id, entry, block, generation, 0)
    assert base is DiskRecord
    return make(object_id, entry, block, generation, 0, version, lo, hi, inner,
                disk_owner)


class NoChild:
    """What :attr:`PrefixEntry.child` reads when there is no hint: it passes no walk's gate
    (so the walk needs no test for its absence)."""

    __slots__ = ()
    gate: ClassVar[int] = -1
    block_hash: ClassVar[bytes] = b""


# (typed as an entry: it is read where one is, and passes no gate, so it is never taken for one)
NO_CHILD = cast("PrefixEntry", NoChild())


@dataclass(slots=True, eq=False)
class PrefixEntry:
    """One hash block of some prefix: the objects of every column that end at this block.

    ``flags`` and ``gate`` summarise readiness of all columns so the funnel's walk is one
    dict lookup plus one integer test per block; they are recomputed by the state view after
    every transition that touches this entry (see ``contracts.summarise``), or, after a
    confirm, by the first walk that reaches it (``contracts.defer``: pending until then).

    Its memory objects, one per column, are slots of its own (``c0``, ``c1``, ...: a class
    per column count, :func:`entry_type`, which ``PrefixEntry(...)`` builds by the length of
    ``records``): read together as :attr:`mem`, set by :func:`set_mem`. (A tuple per entry
    cost 48 B more: its own header and a pointer to it, for millions of entries.)
    """

    block_hash: BlockHash
    parent: PrefixEntry | None
    depth: int  # index of this hash block in its prefix: tokens [depth*H, (depth+1)*H)
    records: InitVar[Sequence[ObjRecord | None]]  # per column, its memory object
    disk: list[ObjRecord | None] | None = None  # disk copies, allocated on first offload
    flags: int = 0
    gate: int = 0  # align if every monotone column is usable, else 0: the walk's one test
    children: int = 0
    # resume points within one window after this block, per SWA column: 32 bits per column,
    # its own window (allocator.swa_policy)
    swa_need: int = 0
    last_used: int = 0
    # Packed handles (HANDLE_DTYPE, one per monotone column, zeros where a column does not
    # live at this depth) built by the first lookup through this entry; summarise drops it
    # whenever anything here changes, so a row never outlives the records it was built from.
    row: bytes | None = None
    # At the last entry of a full run of the packer's run size (runs from depth 0): the
    # run's monotone-column handles, packed from its entries' rows the second time a lookup
    # took them (packing.Packer: a lookup then joins a few run pieces, not a row per block);
    # registered on every entry of the run (a Dependent), so any change to one drops it.
    run: PackedRun | None = field(default=None, repr=False)
    # Lookup memos, walk segments and packed runs computed through this entry (core/memo.py,
    # core/segments.py, core/packing.py); summarise drops them too.
    memos: tuple[Dependent, ...] | list[Dependent] | None = field(default=None, repr=False)
    # The walk segment of the run of blocks this entry ends, if it ends one (segments.py).
    segment: Segment | None = field(default=None, repr=False)
    # The owner-loss epoch through which this entry is known to hold no record of a lost
    # owner (CacheState reaps lost owners lazily: a lookup cleans the entries it walks).
    clean: int = 0
    # The hash of the parent this entry waits for (an orphan: a re-confirm made it before
    # its parent's entry, prefix_index.Orphans); None when it waits for none.
    awaits: BlockHash | None = field(default=None, repr=False)
    # The child a walk through this entry last went on to (or the last one made): the walk
    # asks it first (segments.walk_blocks). Only ever a linked child still in the index.
    child: PrefixEntry = field(default=NO_CHILD, repr=False)


    # the class's: the names of its column slots, and a getter of all of them as a tuple
    _slots: ClassVar[tuple[str, ...]] = ()
    _mem_of: ClassVar[Callable[[PrefixEntry], tuple[ObjRecord | None, ...]]]

    def __new__(cls, block_hash: BlockHash, parent: PrefixEntry | None, depth: int,
                records: Sequence[ObjRecord | None], *args: Any, **kwargs: Any
                ) -> PrefixEntry:
        if cls is PrefixEntry:  # the class with a slot per column
            cls = entry_type(len(records))
        return object.__new__(cls)

    def __post_init__(self, records: Sequence[ObjRecord | None]) -> None:
        pass  # (entry_type's classes set their slots)

    @property
    def mem(self) -> tuple[ObjRecord | None, ...]:
        """Per column, its memory object (None: none), as a tuple built on read."""
        return self._mem_of(self)  # type: ignore[call-arg]  # (a staticmethod)


_COLUMN_SLOT = [f"c{i}" for i in range(256)]  # column -> the slot of its memory object


def mem_at(entry: PrefixEntry, column: int) -> ObjRecord | None:
    """``entry.mem[column]`` without building the tuple (the hot paths' read)."""
    rec: ObjRecord | None = getattr(entry, _COLUMN_SLOT[column])
    return rec


def _no_columns(_entry: PrefixEntry) -> tuple[ObjRecord | None, ...]:
    return ()


def _one_column(entry: PrefixEntry) -> tuple[ObjRecord | None, ...]:
    return (entry.c0,)  # type: ignore[attr-defined]


@functools.cache
def entry_type(columns: int) -> type[PrefixEntry]:
    """The prefix entry class with a slot per column for its memory objects."""
    names = tuple(_COLUMN_SLOT[:columns])
    get = (operator.attrgetter(*names) if columns > 1 else
           _one_column if columns == 1 else _no_columns)
    # one unpacking assignment (a generated line, as dataclasses generate __init__): a loop
    # of setattr tripled the cost of making an entry, and a re-confirm makes many
    targets = "".join(f"self.{n}, " for n in names)
    code = (f"def __post_init__(self, records):\n    {targets}= records\n" if names else
            "def __post_init__(self, records):\n    if records: raise ValueError(records)\n")
    space: dict[str, Any] = {}
    exec(code, space)  # (names are ours: c0, c1, ...)
    return type(f"PrefixEntry{columns}", (PrefixEntry,),
                {"__slots__": names, "_slots": names, "_mem_of": staticmethod(get),
                 "__post_init__": space["__post_init__"]})


def set_mem(entry: PrefixEntry, column: int, rec: ObjRecord | None) -> None:
    """``entry``'s memory object of ``column`` is ``rec`` from now on."""
    setattr(entry, _COLUMN_SLOT[column], rec)


class Dependent(Protocol):
    """Something computed through prefix entries (a lookup memo, a walk segment): a change
    to any of them drops it."""

    live: bool

    def drop(self) -> None: ...


_PRUNE_AT = 4  # an entry's memo list is pruned of dropped ones when it reaches this length


@dataclass(slots=True, eq=False)
class Segment:
    hashes: bytes = field(repr=False)  # the run's hashes, packed
    entries: tuple[PrefixEntry, ...] = field(repr=False)  # (entries point back here)
    gate: int  # the least gate among the entries when it was built
    # per monotone column, the run's packed handle records (packed by the state view)
    cols: tuple[bytes, ...] | None = field(default=None, repr=False)
    live: bool = True

    def drop(self) -> None:
        """Dead from now on (an entry changed); the payload goes at once."""
        self.live = False
        self.entries, self.cols = (), None


class PackedRun:
    """A run's packed monotone-column handles (:attr:`PrefixEntry.run`): one bytes per
    monotone column, as ``Packer`` slices them from the run's rows. A :class:`Dependent` of
    every entry of the run: dead, and its bytes gone, once any of them changes."""

    __slots__ = ("cols", "live")

    def __init__(self, cols: tuple[bytes, ...]) -> None:
        self.cols: tuple[bytes, ...] | None = cols
        self.live = True

    def drop(self) -> None:
        self.live = False
        self.cols = None


def register(item: Dependent, entries: Iterable[PrefixEntry]) -> None:
    """``item`` was computed through ``entries``: a change to any of them drops it.

    Most entries carry one (a tuple: ~40 bytes less than a list, one per entry of a run); an
    entry many share (a hot root's, on every memo through it: up to the table's 1,024) gets a
    list, appended to, and pruned of dropped ones' shells when its length reaches a power of
    two from :data:`_PRUNE_AT` on: O(1) a registration amortised (rebuilding the tuple each
    time, filtered, is O(n) a registration)."""
    one = (item,)
    for e in entries:
        memos = e.memos
        if memos is None:
            e.memos = one
        elif isinstance(memos, tuple):
            e.memos = [*memos, item]
        else:
            n = len(memos)
            if n >= _PRUNE_AT and not n & (n - 1):
                memos[:] = [m for m in memos if m.live]
            memos.append(item)


def drop_memos(entry: PrefixEntry) -> None:
    """``entry`` changed: no memo or walk segment computed through it may answer again."""
    memos = entry.memos
    if memos:
        for m in memos:
            m.drop()
        entry.memos = None
