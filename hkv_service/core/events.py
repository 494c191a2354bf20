"""The state view's recent transitions, as the Watch stream carries them.

The log is bounded (``capacity`` events): a watcher that falls behind is told of the gap, not
sent what is gone. The log keeps each event's record and the state it reached, and builds
the event when it is read: under the state lock a re-confirm logs hundreds of thousands of
events that are mostly overwritten unread, so building them there was a share of its cost.

The log is a ring of ``capacity`` slots made once (a list of records, a list of states, an
array of clock readings), written in place: logging an event makes no object, so logging
adds nothing to what the service's bounded collections walk (``server/gcpolicy.py``). What
each choice saved: ``benchmarks/README.md``, "Measured while deciding".
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from .ids import BlockHash, ObjectId
from .records import ObjRecord
from .states import Kind, State

__all__ = ["EventLog", "TransitionEvent"]


class TransitionEvent(NamedTuple):
    """One applied transition, as the Watch stream carries it."""

    seq: int
    object_id: ObjectId
    kind: Kind
    state: State
    column: str
    block_hash: BlockHash
    at: float


class EventLog:
    """Events with contiguous sequence numbers from 1, the newest ``capacity`` of them kept:
    event ``s`` in slot ``(s - 1) % capacity``. A record named here is kept alive until its
    slot is written again: its id, kind, column and hash never change, and the state it
    reached is copied."""

    __slots__ = ("_at", "_len", "_names", "_records", "_states", "capacity", "last_seq")

    def __init__(self, capacity: int, column_names: Sequence[str]) -> None:
        if capacity < 1:
            raise ValueError(f"an event log holds at least one event, not {capacity}")
        self.capacity = capacity
        self.last_seq = 0  # the newest event's (0: none yet)
        self._names = tuple(column_names)
        self._records: list[ObjRecord | None] = [None] * capacity
        self._states: list[State | None] = [None] * capacity
        self._at = array("d", bytes(8 * capacity))
        self._len = 0

    def add(self, records: Sequence[ObjRecord], states: Sequence[State], at: float) -> None:
        """Log that each of ``records`` reached the state beside it in ``states``, in order."""
        n = len(records)
        if not n:
            return
        cap = self.capacity
        if n > cap:  # only the newest ``cap`` are kept: the rest are gone at once
            self.last_seq += n - cap
            records, states, n = records[n - cap:], states[n - cap:], cap
        i = self.last_seq % cap  # the slot of event last_seq + 1
        if n == 1:  # (a write logs its transitions one call each)
            self._records[i], self._states[i], self._at[i] = records[0], states[0], at
        else:  # in at most two runs of slots: to the ring's end, then from its start
            head = min(n, cap - i)
            self._put(i, records[:head] if head < n else records,
                      states[:head] if head < n else states, at)
            if head < n:
                self._put(0, records[head:], states[head:], at)
        self.last_seq += n
        self._len = min(self._len + n, cap)

    def _put(self, i: int, records: Sequence[ObjRecord], states: Sequence[State],
             at: float) -> None:
        """Slots ``i`` on (the caller keeps them within the ring: a slice assigned a
        sequence of another length would grow or shrink the list)."""
        j = i + len(records)
        self._records[i:j] = records
        self._states[i:j] = states
        self._at[i:j] = array("d", (at,)) * (j - i)

    def __len__(self) -> int:
        return self._len

    @property
    def first_seq(self) -> int:
        """The oldest event's sequence number (``last_seq + 1`` while the log is empty)."""
        return self.last_seq - self._len + 1

    def since(self, seq: int, limit: int) -> list[TransitionEvent]:
        """Up to ``limit`` events after ``seq``, oldest first."""
        start = max(seq + 1, self.first_seq)
        end = min(self.last_seq, start + limit - 1)
        cap = self.capacity
        return [self._event(s, (s - 1) % cap) for s in range(start, end + 1)]

    def records_since(self, seq: int, limit: int) -> list[tuple[ObjRecord, State]]:
        """Up to ``limit`` logged (record, state reached) pairs after ``seq``, oldest first,
        as kept (no event built): what the residency feed reads (core/kvevents.py). The
        caller checks ``first_seq`` for a gap first."""
        start = max(seq + 1, self.first_seq)
        end = min(self.last_seq, start + limit - 1)
        cap, records, states = self.capacity, self._records, self._states
        out: list[tuple[ObjRecord, State]] = []
        for s in range(start, end + 1):
            rec, state = records[(s - 1) % cap], states[(s - 1) % cap]
            assert rec is not None and state is not None, "an event's slot was never written"
            out.append((rec, state))
        return out

    def __iter__(self) -> Iterator[TransitionEvent]:
        return iter(self.since(self.first_seq - 1, self._len))

    def __getitem__(self, i: int) -> TransitionEvent:
        """The ``i``-th event held, oldest first (negative: from the newest)."""
        n = self._len
        if not -n <= i < n:
            raise IndexError("event log index out of range")
        return self.since(self.first_seq - 1 + (i % n), 1)[0]

    def _event(self, seq: int, slot: int) -> TransitionEvent:
        rec, state = self._records[slot], self._states[slot]
        assert rec is not None and state is not None, "an event's slot was never written"
        return TransitionEvent(seq, rec.object_id, rec.kind, state, self._names[rec.column],
                               rec.entry.block_hash, self._at[slot])
