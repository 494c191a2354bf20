"""The state view's recent transitions, as the Watch stream carries them.

The log is bounded (``capacity`` events): a watcher that falls behind is told of the gap, not
sent what is gone. A call that applies many transitions at once (a re-confirm's batch of a
few hundred records, a ``transition_many``) is kept as one chunk: its records and the state
each reached, with one sequence number range and one clock reading. An event is built when
it is read. Building every event under the state lock (a 7-field tuple, its column name and
hash looked up, the oldest event let go) was 15% of a confirm's samples in a 4M-object
view's re-confirm (py-spy, ad-hoc), for history that a restart's re-confirm of 500k records
overwrites mostly unread; chunked, that re-confirm ran 148k -> 164k reports/s (ad-hoc, best
of 2 per process, median of 3 interleaved processes).
"""

from __future__ import annotations

from collections import deque
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


class _Chunk(NamedTuple):
    first: int  # the sequence number of records[0]'s event
    at: float
    records: tuple[ObjRecord, ...]
    states: tuple[State, ...]  # the state each record reached (a record moves on later)


_new_tuple = tuple.__new__


class EventLog:
    """Events with contiguous sequence numbers from 1, the newest ``capacity`` of them kept.
    A record named here is kept alive until its chunk goes (at most ``capacity`` records):
    its id, kind, column and hash never change, and the state it reached is copied."""

    __slots__ = ("_chunks", "_gone", "_len", "_names", "capacity", "last_seq")

    def __init__(self, capacity: int, column_names: Sequence[str]) -> None:
        if capacity < 1:
            raise ValueError(f"an event log holds at least one event, not {capacity}")
        self.capacity = capacity
        self.last_seq = 0  # the newest event's (0: none yet)
        self._names = tuple(column_names)
        self._chunks: deque[_Chunk] = deque()
        self._gone = 0  # events at the front of the oldest chunk already let go
        self._len = 0

    def add(self, records: Sequence[ObjRecord], states: Sequence[State], at: float) -> None:
        """Log that each of ``records`` reached the state beside it in ``states``, in order."""
        n = len(records)
        if not n:
            return
        # (tuple.__new__: a named tuple's own __new__ is a Python frame, ~3x the cost, and a
        # write logs its transitions one call each)
        self._chunks.append(_new_tuple(_Chunk, (self.last_seq + 1, at, tuple(records),
                                                tuple(states))))
        self.last_seq += n
        self._len += n
        excess = self._len - self.capacity
        while excess > 0:  # let the oldest go: whole chunks, then part of one
            held = len(self._chunks[0].records) - self._gone
            if held <= excess:
                self._chunks.popleft()
                self._gone = 0
                self._len -= held
                excess -= held
            else:
                self._gone += excess
                self._len -= excess
                excess = 0

    def __len__(self) -> int:
        return self._len

    @property
    def first_seq(self) -> int:
        """The oldest event's sequence number (``last_seq + 1`` while the log is empty)."""
        return self.last_seq - self._len + 1

    def since(self, seq: int, limit: int) -> list[TransitionEvent]:
        """Up to ``limit`` events after ``seq``, oldest first. Found from the newest end: a
        watcher asks for what came after the last event it saw, most often the last few."""
        start = max(seq + 1, self.first_seq)
        if start > self.last_seq or limit <= 0:
            return []
        # the chunks from the one holding ``start`` on, found from the newest end (iterated,
        # not indexed: a deque's index walks from its nearer end, a read of all was quadratic)
        newest_first: list[_Chunk] = []
        for chunk in reversed(self._chunks):
            newest_first.append(chunk)
            if chunk.first <= start:
                break
        out: list[TransitionEvent] = []
        for chunk in reversed(newest_first):
            j = start - chunk.first
            while j < len(chunk.records) and len(out) < limit:
                out.append(self._event(chunk, j))
                j += 1
            if len(out) >= limit:
                break
            start = chunk.first + len(chunk.records)
        return out

    def __iter__(self) -> Iterator[TransitionEvent]:
        return iter(self.since(self.first_seq - 1, self._len))

    def __getitem__(self, i: int) -> TransitionEvent:
        """The ``i``-th event held, oldest first (negative: from the newest)."""
        n = self._len
        if not -n <= i < n:
            raise IndexError("event log index out of range")
        return self.since(self.first_seq - 1 + (i % n), 1)[0]

    def _event(self, chunk: _Chunk, j: int) -> TransitionEvent:
        rec = chunk.records[j]
        return TransitionEvent(chunk.first + j, rec.object_id, rec.kind, chunk.states[j],
                               self._names[rec.column], rec.entry.block_hash, chunk.at)
