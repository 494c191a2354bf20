"""What a lookup answers (:class:`Match`) and what a lookup memo keeps (:class:`Memo`): the
values the state view hands out and caches. They refer to each other (a lease-free match names
the memo that answered it; a memo keeps the match's packed columns), so they live together,
above the funnel whose results they carry and below the memo table and the state view.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .funnel import Downgrade, FunnelResult
from .ids import BlockHash, LeaseId
from .records import Handle, HandleColumn, ObjRecord

__all__ = ["KeyFields", "Match", "Memo", "MemoKey"]


class MemoKey(NamedTuple):
    """Everything a lookup's answer depends on besides its entries (``LookupMemo.key_at``
    builds it; a hit compares the whole prefix too, byte for byte)."""

    last_hash: BlockHash
    n_hashes: int  # hashes of the prefix
    limit: int  # tokens the lookup may resume at
    alignment: int
    handles: bool
    reader_abi: tuple[tuple[str, int], ...]
    first_block: int
    open_end: bool
    owners_epoch: int  # the owner table's (a replay checks it)


# A key as a lookup builds it: a plain tuple in MemoKey's field order, equal to the MemoKey
# a memo keeps and hashing alike (a NamedTuple takes ~0.5 us to make; a memo hit's whole
# lookup takes ~4 us)
KeyFields = tuple[BlockHash, int, int, int, bool, tuple[tuple[str, int], ...], int, bool, int]


@dataclass(slots=True, eq=False)
class Memo:
    key: MemoKey
    hashes: bytes  # the request's hashes, packed: a hit compares the whole prefix in one memcmp
    result: FunnelResult | None
    columns: Mapping[str, HandleColumn] | None  # None: a match-only lookup
    records: dict[str, tuple[ObjRecord, ...]] | None  # what a lease pins (built on first lease)
    nbytes: int
    wire: bytes | None = None  # the lease-free match as the edge answers it (LookupMemo.encoder)
    live: bool = True

    def drop(self) -> None:
        """Dead from now on; the payload goes at once (entries may still point at the shell)."""
        self.live = False
        self.result = self.columns = self.records = self.wire = None


@dataclass(frozen=True)
class Match:
    """What a lookup returns. ``columns`` is a snapshot taken atomically with the lookup.

    Handles stay valid while ``lease_id`` is live; without a lease a reader may find them stale
    (the shard and ``check_read`` re-check generation and state), never wrong. ``handles``
    materialises one :class:`Handle` per object on first access; the server packs ``columns``
    directly instead.
    """

    usable_tokens: int
    matched_tokens: int
    downgrades: tuple[Downgrade, ...]
    lease_id: LeaseId | None = None
    columns: Mapping[str, HandleColumn] = field(default_factory=dict, compare=False)
    # The memo that answered this lease-free lookup, else None; opaque to callers. Its
    # ``wire`` is this match as the edge's encoder wrote it (LookupMemo.encoder), and
    # CacheState.replay(memo) repeats the lookup for as long as nothing on its path changed.
    memo: Memo | None = field(default=None, compare=False, repr=False)
    # False when the memo is the prefix's the walk stopped at (a miss past it): the same
    # request may get a longer answer once the missing block is written, so it is not replayed.
    repeatable: bool = field(default=True, compare=False, repr=False)

    @functools.cached_property
    def handles(self) -> Mapping[str, tuple[Handle, ...]]:
        """column -> handles, in token order."""
        return {name: col.handles() for name, col in self.columns.items()}

    @functools.cached_property
    def load(self) -> tuple[Handle, ...]:
        """DISK objects at rest (no memory block behind them) to load before reading."""
        return tuple(h for hs in self.handles.values() for h in hs if h.block < 0)

    @property
    def needs_load(self) -> bool:
        return bool(self.load)
