"""The small typed values that cross the data plane (Ray) between inference workers and
shards: per-item outcomes, a packed read, a write's commit. Each is a frozen dataclass or a
``StrEnum`` so it pickles small and plain (bytes travel beside it as numpy arrays).

What the workers need from the metadata service is the core's port
(:class:`hkv_service.core.port.MetadataPort`); a disk record's tag is :mod:`workers.tags`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from hkv_service.core.api import Handle, Params
from hkv_service.core.errors import WrongSize
from hkv_service.core.layout import Layout
from hkv_service.core.states import Event, Kind

__all__ = [
    "Commit",
    "ItemResult",
    "Outcome",
    "PackedRead",
    "commit_bytes",
    "payload_bytes",
]


class Outcome(enum.StrEnum):
    """Per-item result of a data-plane call. Anything but OK means: recompute this block."""

    OK = "OK"
    STALE = "STALE"  # generation moved on (block freed or reused): stale, recompute
    LOST = "LOST"  # the metadata service no longer knows the object (owner lost, evicted)
    NOT_READABLE = "NOT_READABLE"  # the object is not in a state that allows this
    ADMISSION = "ADMISSION"  # refused by an admission cap; retry later
    DISK_FULL = "DISK_FULL"  # the disk tier's budget or file system is full
    CORRUPT = "CORRUPT"  # checksum mismatch: quarantined, marked CORRUPT, never served
    MISSING = "MISSING"  # the disk record is gone (evicted by the tier's LRU)
    NOT_HERE = "NOT_HERE"  # this shard's disk tier does not hold the record
    UNAVAILABLE = "UNAVAILABLE"  # the shard holding the bytes died or timed out
    FAILED = "FAILED"  # anything else; ``detail`` says what


@dataclass(frozen=True, slots=True)
class ItemResult:
    outcome: Outcome
    detail: str = ""
    handle: Handle | None = None  # load: the memory handle the bytes now sit behind
    version: int = 0  # write: KV version issued by a compressed WRITE_DONE
    # The error that refused the item, where one did (its class: what a caller reads, never
    # the detail's text); None where none did
    cause: type[BaseException] | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


class PackedRead(Sequence["np.ndarray | ItemResult"]):
    """A shard's answer to ``read_blocks``: a few buffers instead of one Ray object per block.
    Small blocks are packed into one buffer (per-object overhead dominates them); large ones
    travel as their own zero-copy views. ``spans[i]`` is ``(buffer, offset, length)`` or the
    ``ItemResult`` of a handle that could not be read. Indexing yields a view or the result."""

    def __init__(
        self, buffers: list[np.ndarray], spans: list[tuple[int, int, int] | ItemResult]
    ) -> None:
        self.buffers = buffers
        self.spans = spans

    def __len__(self) -> int:
        return len(self.spans)

    @overload
    def __getitem__(self, i: int) -> np.ndarray | ItemResult: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray | ItemResult]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        span = self.spans[i]
        if isinstance(span, ItemResult):
            return span
        buf, start, length = span
        return self.buffers[buf][start : start + length]


@dataclass(frozen=True, slots=True)
class Commit:
    """Transitions a shard reports after a write is readable, in order (e.g. WRITE_DONE then
    INDEXER_SYNC). ``params[i]`` goes with ``events[i]``."""

    events: tuple[Event, ...]
    params: tuple[Params | None, ...] = ()

    def params_at(self, i: int) -> Params | None:
        return self.params[i] if i < len(self.params) else None

    def merged(self) -> Params:
        """Every parameter the commit sets, the last given of each (what the object ends
        with: its version, SWA range, tail length)."""
        out = Params()
        for p in self.params:
            if p is not None:
                out = Params(*(new if new is not None else old for new, old in zip(
                    (p.version, p.lo, p.hi, p.tail_len, p.expect_seq),
                    (out.version, out.lo, out.hi, out.tail_len, out.expect_seq), strict=True)))
        return out


def commit_bytes(layout: Layout, column: int, depth: int | None,
                 commit: Commit | None) -> int | None:
    """Exactly the bytes a write of ``column`` committed with ``commit`` must carry
    (:meth:`Layout.object_bytes`: an SWA block's range and a tail's length come from the
    commit's parameters, the last given wins). None where that cannot be told: a range or a
    tail length that needs the block's depth, and no depth known."""
    m = commit.merged() if commit else Params()
    lo, hi, tail_len = m.lo, m.hi, m.tail_len
    kind = layout.columns[column].kind
    if kind is Kind.SWA and lo is None and hi is None:
        return layout.columns[column].nbytes  # the whole block: no depth needed
    if kind is Kind.TAIL and tail_len is not None:
        return layout.object_bytes(column, 0, tail_len=tail_len)
    if kind in (Kind.SWA, Kind.TAIL) and depth is None:
        return None
    return layout.object_bytes(column, depth or 0, lo, hi, tail_len)


def size_refusal(layout: Layout, column: int, group: str, depth: int | None,
                 commit: Commit | None, got: int) -> ItemResult | None:
    """None if ``got`` bytes are exactly the object's a write of ``column`` (``group``) with
    ``commit`` (and its block's ``depth``, when known) must carry; else the refusal. A short
    write would be committed over a block whose rest is another object's. The shard and a
    worker that claims blocks itself ask this one rule."""
    if not 0 <= column < len(layout.columns) or layout.columns[column].name != group:
        return ItemResult(Outcome.FAILED, f"bad handle: column {column} is not {group!r}")
    want = commit_bytes(layout, column, depth, commit)
    if want is None:
        return ItemResult(Outcome.FAILED, f"{group}: the object's size depends on its depth "
                                          "or range: pass its tag or its commit")
    if got != want:
        return ItemResult(Outcome.FAILED, str(WrongSize(f"write of {group!r}", want, got)))
    return None


def payload_bytes(data: Any) -> int:
    """Bytes in a block's data: a numpy array, a torch tensor or anything bytes-like."""
    nbytes = getattr(data, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else memoryview(data).nbytes
