"""Torch block pools: the bytes behind the metadata service's handles, one pool per column.

Each column (a cache group, or ``<group>.tail``) gets one ``uint8`` tensor of
``num_blocks x stride`` bytes, allocated once: on the GPU when CUDA is present, else in pinned
host memory (plain host memory if pinning fails). ``stride`` is the block size rounded up to
:data:`ALIGN` bytes, so every block starts aligned; the base alignment reported to the metadata
service is what the allocation actually has.

Per physical block the pool keeps the generation and object id the metadata service issued
with the handle, and a readiness token::

    write(block, gen, data)   gen < current -> StaleWrite (a late writer never clobbers reuse)
                              sets (gen, object, length) first, then copies and zeroes the
                              rest of the block: it never shows an earlier occupant's bytes
    ready event completes  -> block "readable" (CUDA: side-stream event; CPU: at once)
    read(block, gen)          (gen, object) re-checked right before the copy -> StaleRead;
                              exactly the ``length`` bytes written, never more

"Written" and "readable" are distinct: a read waits for the block's copy event, so a caller
never sees a half-finished device copy. Bytes cross process boundaries as numpy arrays, or,
for host pools in a shared segment (``PoolSet(shared=True)``, :mod:`workers.shm`), are copied
by a worker on the node straight from and into the segment::

    claim(block, gen, n, writer)   write rules as above; seq odd, (gen, object, length) set,
                                   the rest zeroed; no other write takes the block while the
                                   writer process lives
    (the worker copies its n bytes into the block)
    finish(block, gen, writer)     seq even: readable
    read by a worker               seq, gen, object checked before and after its copy

A claim and a finish are made by the shard or by the worker itself (``Slots``: one home for
the rules, under the pool's lock that both take, ``workers.shm.MetaLock``); the shard's own
copies out of a shared pool are made under that lock too.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import torch

from hkv_service.core.api import Handle, PoolConfig
from hkv_service.core.ids import GroupName, ObjectId, ShardId
from hkv_service.core.states import Kind

from .ports import ItemResult, Outcome
from .shm import META_FIELDS, MetaLock, Segment, Writer, writer_alive

__all__ = ["ALIGN", "BlockPool", "HandleBatch", "PoolSet", "Slots", "StaleRead", "StaleWrite",
           "round_up"]

ALIGN = 256  # bytes between block starts are a multiple of this
_EMPTY = -1
_cuda: Any = torch.cuda  # untyped in some torch builds
log = logging.getLogger(__name__)

Bytes = npt.NDArray[np.uint8]


class StaleRead(Exception):
    """The block's generation or occupant moved on: the caller must recompute."""


class StaleWrite(Exception):
    """A write carried a generation older than the block's: the block was reused meanwhile."""


def round_up(n: int, align: int = ALIGN) -> int:
    return max(align, -(-n // align) * align)


def _largest_pow2_dividing(address: int, cap: int = 1 << 12) -> int:
    return min(address & -address, cap) if address else cap


@dataclass(slots=True)
class _Ready:
    """Readiness of one block: a CUDA event, or nothing (CPU copies finish in ``write``)."""

    event: Any = None

    def wait(self) -> None:
        if self.event is not None and not self.event.query():
            self.event.synchronize()


def _check_size(name: str, capacity: int, nbytes: int) -> None:
    if not 0 < nbytes <= capacity:
        raise ValueError(f"{nbytes} bytes cannot be a {name!r} object: a block holds 1 to "
                         f"{capacity}")


class Slots:
    """One pool's per-block records and the rules that change them, in one place for the
    shard and for a worker on its node that claims blocks itself (``workers.shared``): the
    records may live in a shared segment that both map. Every method but :meth:`claimed_by`
    expects the caller to hold ``lock``.

    A claim is made in an order that a process killed at any point leaves safe: the claimant
    first (``claim_pid`` last, so a record is whole once it shows), then ``seq`` odd, then the
    object; a finish makes ``seq`` even before it clears the claimant. A claimant found dead
    (:meth:`check_claim`) is undone from what is left: ``seq`` odd means the bytes may be
    half-copied (the block then holds no object); ``seq`` even means the block holds what it
    held before the claim, or the claimed object's whole bytes after its finish."""

    __slots__ = ("claim_pid", "claim_start", "generation", "length", "lock", "name", "nbytes",
                 "object_id", "rows", "seq")

    def __init__(self, name: str, nbytes: int, meta: Mapping[str, np.ndarray], lock: MetaLock,
                 rows: np.ndarray | None) -> None:
        self.name, self.nbytes, self.lock, self.rows = name, nbytes, lock, rows
        self.seq, self.generation = meta["seq"], meta["generation"]
        self.object_id, self.length = meta["object_id"], meta["length"]
        self.claim_pid, self.claim_start = meta["claim_pid"], meta["claim_start"]

    def claimed_by(self, block: int) -> Writer | None:
        pid = int(self.claim_pid[block])
        return (pid, int(self.claim_start[block])) if pid else None

    def open(self, block: int) -> None:
        """``seq`` odd: the bytes are changing (kept odd if a dead claimant left it so)."""
        self.seq[block] += 1 if not self.seq[block] & 1 else 2

    def close(self, block: int) -> None:
        if self.seq[block] & 1:
            self.seq[block] += 1

    def claim(self, block: int, generation: int, object_id: int, nbytes: int,
              writer: Writer) -> None:
        """Let ``writer`` copy ``nbytes`` bytes of ``object_id`` into ``block`` itself. Until
        :meth:`finish` the block reads as being written (odd ``seq``) and no other write or
        claim takes it while the writer lives: a stalled copy never lands in a block reused
        meanwhile (a dead writer writes nothing, so its claim lapses). The write rules of
        ``BlockPool.write`` hold; a claim the writer already holds is granted again."""
        _check_size(self.name, self.nbytes, nbytes)
        if self.claimed_by(block) == writer and (int(self.generation[block]),
                                                 int(self.object_id[block])) == (generation,
                                                                                 object_id):
            return
        self.check_claim(block, generation, object_id)
        self.check_stale(block, generation, object_id)
        self.claim_start[block] = writer[1]
        self.claim_pid[block] = writer[0]
        self.open(block)
        self.generation[block] = generation
        self.object_id[block] = object_id
        self.length[block] = nbytes
        if self.rows is not None and nbytes < self.nbytes:
            self.rows[block, nbytes : self.nbytes] = 0  # no earlier occupant's bytes

    def claim_result(self, block: int, generation: int, object_id: int, nbytes: int,
                     writer: Writer) -> ItemResult:
        """:meth:`claim` as a write's item result, what the shard's ``claim_blocks`` and a
        worker claiming itself both answer: OK, STALE (a write rule), FAILED (a block
        outside the pool, a size no object of the pool has)."""
        if not 0 <= block < len(self.seq):
            return ItemResult(Outcome.FAILED, f"block {block} is outside {self.name!r} "
                                              f"(0..{len(self.seq) - 1})")
        try:
            self.claim(block, generation, object_id, nbytes, writer)
        except StaleWrite as exc:
            return ItemResult(Outcome.STALE, str(exc))
        except ValueError as exc:
            return ItemResult(Outcome.FAILED, str(exc))
        return _GRANTED

    def finish(self, block: int, generation: int, object_id: int, writer: Writer) -> None:
        """``writer`` copied its claimed bytes: the block is readable (StaleWrite if the claim
        is not the writer's any more)."""
        if self.claimed_by(block) != writer or (int(self.generation[block]),
                                                int(self.object_id[block])) != (generation,
                                                                                object_id):
            raise StaleWrite(f"{self.name!r} block {block}: the claim of generation "
                             f"{generation} (object {object_id}) is not held")
        self.close(block)
        self.claim_pid[block] = 0

    def release(self, block: int, generation: int, object_id: int, writer: Writer) -> None:
        """``writer`` gives its claim up (its copy failed): the block holds no object."""
        if self.claimed_by(block) == writer and (int(self.generation[block]),
                                                 int(self.object_id[block])) == (generation,
                                                                                 object_id):
            self.object_id[block] = _EMPTY
            self.close(block)
            self.claim_pid[block] = 0

    def check_claim(self, block: int, generation: int, object_id: int) -> None:
        """Refuse a write or claim of ``block`` while another live writer holds a claim on it;
        a dead writer's claim is undone (its half-copied bytes are no object's)."""
        writer = self.claimed_by(block)
        if writer is None:
            return
        if writer_alive(writer):
            raise StaleWrite(f"{self.name!r} block {block} is being written by process "
                             f"{writer[0]} (generation {int(self.generation[block])}); "
                             f"generation {generation} (object {object_id}) must wait")
        if self.seq[block] & 1:
            self.object_id[block] = _EMPTY
            self.close(block)
        self.claim_pid[block] = 0

    def check_stale(self, block: int, generation: int, object_id: int) -> None:
        """The write rules a write and a claim obey: never an older generation, nor another
        object at the same one, nor new bytes for the object that holds the block."""
        current, holder = int(self.generation[block]), int(self.object_id[block])
        if generation < current or (
            generation == current and _EMPTY not in (holder, object_id) and holder != object_id
        ):
            raise StaleWrite(
                f"{self.name!r} block {block} is at generation {current} (object {holder}); "
                f"write for generation {generation} (object {object_id}) is stale"
            )
        if generation == current and holder == object_id != _EMPTY:
            raise StaleWrite(
                f"{self.name!r} block {block} holds object {object_id}'s bytes already; an "
                "object's bytes never change (a rewrite goes to a fresh object)")

    def forget(self, block: int, object_id: int) -> None:
        if int(self.object_id[block]) == object_id:
            self.object_id[block] = _EMPTY


_GRANTED = ItemResult(Outcome.OK)  # one shared object: a batch of them pickles as memo refs
HOST_ALIGN = 4096  # base alignment of host pools
_DONE = _Ready()  # host copies are readable when write() returns: one shared token

_Column = tuple[ShardId, int, Kind, GroupName, int, int]  # shard, column, kind, group, nbytes, abi
_ROW = ("object_id", "generation", "block", "address")


class HandleBatch(Sequence[Handle]):
    """Handles as columns: what a data-plane call carries instead of one pickled
    :class:`Handle` per block. Ray pickles call arguments with cloudpickle, which runs a
    Python hook for every object that is not a builtin container or scalar: 1,024 handles
    cost ~10 ms there and back, the batch (one int64 array and a tuple per distinct column)
    ~0.1 ms. ``rows[i]`` is ``(column slot, object id, generation, block, address)``;
    ``columns[slot]`` is what the handles of one column share. Indexing rebuilds a Handle."""

    __slots__ = ("columns", "rows")

    def __init__(self, columns: tuple[_Column, ...], rows: np.ndarray) -> None:
        self.columns = columns
        self.rows = rows

    @classmethod
    def of(cls, handles: Iterable[Handle]) -> HandleBatch:
        if isinstance(handles, HandleBatch):
            return handles
        slots: dict[_Column, int] = {}
        flat: list[int] = []
        for h in handles:
            key = (h.shard, h.column, h.kind, h.group, h.nbytes, h.abi_fingerprint)
            slot = slots.get(key)
            if slot is None:
                slot = slots[key] = len(slots)
            flat += (slot, h.object_id, h.generation, h.block, h.address)
        rows = np.array(flat, dtype=np.int64).reshape(-1, 5)
        return cls(tuple(slots), rows)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # bytes, not the array: Ray moves a numpy argument out of band (~0.3 ms a call more)
        return (_batch_from_bytes, (self.columns, self.rows.tobytes()))

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Handle: ...
    @overload
    def __getitem__(self, i: slice) -> HandleBatch: ...
    def __getitem__(self, i: int | slice) -> Handle | HandleBatch:
        if isinstance(i, slice):
            return HandleBatch(self.columns, self.rows[i])
        slot, oid, gen, block, address = (int(x) for x in self.rows[i])
        shard, column, kind, group, nbytes, abi = self.columns[slot]
        return Handle(ObjectId(oid), gen, shard, column, block, kind, group, nbytes, abi, address)

    def take(self, index: Sequence[int]) -> HandleBatch:
        return HandleBatch(self.columns, self.rows[np.asarray(index, dtype=np.intp)])

    def field(self, name: str) -> np.ndarray:
        """One per-item column: ``object_id``, ``generation``, ``block`` or ``address``."""
        return self.rows[:, 1 + _ROW.index(name)]

    def slot_of(self) -> np.ndarray:
        return self.rows[:, 0]


class BlockPool:
    """``num_blocks`` blocks of ``nbytes`` (stride ``round_up(nbytes)``) for one column."""

    def __init__(self, name: str, nbytes: int, num_blocks: int, device: torch.device,
                 stride_pad: int = 0, segment: Segment | None = None) -> None:
        self.name, self.nbytes, self.num_blocks = name, nbytes, num_blocks
        self.stride = round_up(nbytes) + stride_pad  # pad: see ShardConfig.pool_stride_pad
        self.device = device
        if segment is None:
            # a padded pool also starts ``stride_pad`` bytes into its buffer: none of its
            # blocks is then aligned beyond the pad's own alignment
            self.tensor = _allocate(num_blocks * self.stride + stride_pad, device)[stride_pad:]
            meta = {f: np.zeros(num_blocks, dtype=np.int64) for f in META_FIELDS}
        else:  # in shared memory (host pools only): workers on this node map it
            assert device.type == "cpu", "only host pools live in a shared segment"
            self.tensor, meta = segment.data(name), segment.meta(name)
        self.seq = meta["seq"]  # even; odd while the bytes change (see workers.shm)
        self.generation = meta["generation"]
        self.object_id = meta["object_id"]
        self.object_id[:] = _EMPTY
        self.length = meta["length"]  # bytes the occupant wrote
        self._ready = [_DONE] * num_blocks
        self._stream = _cuda.Stream(device) if device.type == "cuda" else None
        # Host pools are read and written through one numpy view (no torch on the hot path).
        self._host = None if device.type == "cuda" else self.tensor.numpy().reshape(num_blocks, -1)
        self.shared = segment is not None  # workers on this node change the records too
        self.slots = Slots(name, nbytes, meta, segment.lock(name) if segment else MetaLock(),
                           self._host)

    @property
    def config(self) -> PoolConfig:
        return PoolConfig(self.num_blocks, self.stride, _largest_pow2_dividing(self.base_address),
                          device=self.tensor.device.type)

    @property
    def base_address(self) -> int:
        return int(self.tensor.data_ptr())

    # -- writes ---------------------------------------------------------------------------

    def write(self, block: int, generation: int, data: Any, object_id: int = 0) -> None:
        """Copy ``data`` (bytes-like or array, 1 to ``nbytes`` bytes) into ``block``; the rest
        of the block is zeroed and reads return exactly these bytes. The caller checked that
        the size is its object's (``Layout.object_bytes``).

        One set of bytes per object: a write naming the object that already holds the block
        (same generation and id) must bring the very same bytes (a retry: nothing changes),
        else it raises StaleWrite and the block keeps them. A reader, a lease, a re-confirm
        or a tag may name that object, so its bytes never change; a rewrite goes to a fresh
        object (``AllocRequest.replace``). Raises StaleWrite too for a generation older than
        the block's, or a different object at the same generation. An empty block (never
        written, or ``forget``-ten) is never readable, whatever its generation.
        """
        self._check_block(block)
        src = _as_bytes(data)
        _check_size(self.name, self.nbytes, src.size)
        slots = self.slots
        with slots.lock:  # (a worker's claim of this block waits: the records are one state)
            slots.check_claim(block, generation, object_id)
            current, holder = int(self.generation[block]), int(self.object_id[block])
            if generation == current and holder == object_id != _EMPTY and \
                    self._holds(block, src):
                return  # a retry of the same write: its bytes are there
            slots.check_stale(block, generation, object_id)
            slots.open(block)  # odd: a reader copying from shared memory now discards
            self.generation[block] = generation  # claim first: a racing reader sees stale
            self.object_id[block] = object_id
            self.length[block] = src.size
            self._copy_in(block, src)
            slots.close(block)

    # -- writes by a worker on this node (workers.shared) ---------------------------------

    def claim(self, block: int, generation: int, object_id: int, nbytes: int,
              writer: Writer) -> None:
        """Let ``writer`` (a process on this node) copy ``nbytes`` bytes of ``object_id`` into
        ``block`` of the shared segment itself (:meth:`Slots.claim`); :meth:`finish` makes
        them readable."""
        self._check_block(block)
        assert self._host is not None, "claims need a host pool"
        with self.slots.lock:
            self.slots.claim(block, generation, object_id, nbytes, writer)

    def finish(self, block: int, generation: int, object_id: int, writer: Writer) -> None:
        """``writer`` copied its claimed bytes: the block is readable (StaleWrite if the claim
        is not the writer's any more)."""
        self._check_block(block)
        with self.slots.lock:
            self.slots.finish(block, generation, object_id, writer)
        self._ready[block] = _DONE

    def release(self, block: int, generation: int, object_id: int, writer: Writer) -> None:
        """``writer`` gives its claim up (its copy failed): the block holds no object."""
        with self.slots.lock:
            self.slots.release(block, generation, object_id, writer)

    def _holds(self, block: int, src: Bytes) -> bool:
        """Whether ``block`` holds exactly ``src`` (the bytes its occupant wrote)."""
        if int(self.length[block]) != src.size:
            return False
        self._ready[block].wait()
        if self._host is not None:
            return bool(np.array_equal(self._host[block, : src.size], src))
        start = block * self.stride
        held = self.tensor[start : start + src.size].to("cpu").numpy()
        return bool(np.array_equal(held, src))

    def _copy_in(self, block: int, src: Bytes) -> None:
        if self._host is not None:
            self._host[block, : src.size] = src
            self._host[block, src.size : self.nbytes] = 0  # no earlier occupant's bytes
            self._ready[block] = _DONE
            return
        assert self._stream is not None
        with warnings.catch_warnings():  # arrays from Ray are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            staged = torch.from_numpy(np.ascontiguousarray(src))
        if src.size >= 1 << 16:
            staged = staged.pin_memory()
        start = block * self.stride
        with _cuda.stream(self._stream):
            self.tensor[start : start + src.size].copy_(staged, non_blocking=True)
            self.tensor[start + src.size : start + self.nbytes].zero_()
            event = _cuda.Event()
            event.record(self._stream)
        self._ready[block] = _Ready(event)

    def wait(self, block: int) -> None:
        """Block until ``block``'s last write is readable."""
        self._ready[block].wait()

    def forget(self, block: int, object_id: int) -> None:
        """Drop ``object_id``'s claim on ``block`` (its commit was refused): the bytes are
        unreadable through any handle, and the block's next writer may claim it."""
        with self.slots.lock:
            self.slots.forget(block, object_id)

    # -- reads ----------------------------------------------------------------------------

    def read(
        self, block: int, generation: int, object_id: int = _EMPTY, copy: bool = True
    ) -> Bytes:
        """The block's ``nbytes`` bytes, if ``(generation, object_id)`` is still current.

        ``copy=False`` on a private host pool returns a view into the pool: valid only until
        the next write to the block (the shard hands it straight to Ray, which copies it out).
        A pool in a shared segment always copies (a worker's claim does not wait for Ray).
        """
        self._check_block(block)
        self._ready[block].wait()  # readable = the write's copy completed
        if self.shared:  # a worker may claim the block at any time: check and copy locked
            with self.slots.lock:
                self.check(block, generation, object_id)
                assert self._host is not None
                return self._host[block, : int(self.length[block])].copy()
        self.check(block, generation, object_id)
        n = int(self.length[block])
        if self._host is not None:
            view = self._host[block, :n]
            return view.copy() if copy else view
        start = block * self.stride
        out = self.tensor[start : start + n].to("cpu")
        self.check(block, generation, object_id)  # a write that raced the device copy
        return out.numpy()

    def readable(self, blocks: np.ndarray, generations: np.ndarray,
                 object_ids: np.ndarray) -> np.ndarray:
        """The read check of :meth:`read` for many blocks at once (all in range): waits until
        each block's last write is readable, then one bool per item, True where
        ``(generation, object)`` is current. Call it right before taking the bytes."""
        if self._stream is not None:  # host pools finish their copies in write()
            for b in blocks.tolist():
                self._ready[b].wait()
        holder = self.object_id[blocks]
        ok: np.ndarray = ((self.generation[blocks] == generations) & (holder != _EMPTY)
                          & ((object_ids == _EMPTY) | (holder == object_ids))
                          & ((self.seq[blocks] & 1) == 0))  # not while a worker fills it
        return ok

    def take(self, first: int, count: int) -> np.ndarray:
        """Blocks ``first .. first+count-1`` as one flat ``uint8`` array of
        ``count * stride`` bytes (the last block trimmed to ``nbytes``): a view into a host
        pool (valid until the next write to those blocks: in a shared pool, copy it while
        holding ``slots.lock`` and check :meth:`readable` under it), a host copy of a device
        pool (the caller re-checks with :meth:`readable` afterwards: a write may have raced
        the copy)."""
        start = first * self.stride
        end = start + (count - 1) * self.stride + self.nbytes
        if self._host is not None:
            return self._host.reshape(-1)[start:end]
        return self.tensor[start:end].to("cpu").numpy()

    def coalesces(self) -> bool:
        """Whether adjacent blocks are worth moving as one span (padding under 1/16)."""
        return (self.stride - self.nbytes) * 16 <= self.nbytes

    def check(self, block: int, generation: int, object_id: int = _EMPTY) -> None:
        current, holder = int(self.generation[block]), int(self.object_id[block])
        if current != generation or holder == _EMPTY or self.seq[block] & 1 or (
            object_id != _EMPTY and holder != object_id
        ):
            raise StaleRead(
                f"{self.name!r} block {block} holds generation {current} (object {holder}), "
                f"not {generation} (object {object_id}): stale, recompute"
            )

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is outside {self.name!r} (0..{self.num_blocks - 1})")


def _batch_from_bytes(columns: tuple[_Column, ...], raw: bytes) -> HandleBatch:
    return HandleBatch(columns, np.frombuffer(raw, dtype=np.int64).reshape(-1, 5))


class PoolSet:
    """One :class:`BlockPool` per column, built from ``{column: nbytes}``."""

    def __init__(self, columns: Mapping[str, int], num_blocks: int, device: str = "auto",
                 stride_pad: int = 0, shared: bool = False) -> None:
        """``shared``: host pools go into one shared-memory :class:`~workers.shm.Segment`
        (``self.segment``) that workers on this node map; device pools never do."""
        self.device = pick_device(device)
        self.segment: Segment | None = None
        if shared and self.device.type == "cpu":
            self.segment = Segment({n: (b, round_up(b) + stride_pad) for n, b in columns.items()},
                                   num_blocks, stride_pad)
        self.pools = {
            name: BlockPool(name, nbytes, num_blocks, self.device, stride_pad, self.segment)
            for name, nbytes in columns.items()
        }

    def configs(self) -> dict[str, PoolConfig]:
        return {name: pool.config for name, pool in self.pools.items()}

    def __getitem__(self, column: str) -> BlockPool:
        return self.pools[column]

    def get(self, column: str) -> BlockPool | None:
        return self.pools.get(column)

    def nbytes(self) -> int:
        return sum(p.num_blocks * p.stride for p in self.pools.values())


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # the caching allocator hands out 512-byte aligned blocks
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    raw = torch.zeros(nbytes + HOST_ALIGN, dtype=torch.uint8)
    try:
        if torch.cuda.is_available():  # pinning needs a CUDA runtime; skip the attempt otherwise
            raw = raw.pin_memory()
    except RuntimeError as exc:
        log.warning("pinning %d bytes failed (%s); using pageable host memory", nbytes, exc)
    # malloc gives 16-64 byte alignment; readers (and DMA) want page-aligned blocks
    offset = -raw.data_ptr() % HOST_ALIGN
    return raw[offset : offset + nbytes]


def _as_bytes(data: Any) -> Bytes:
    if isinstance(data, np.ndarray):
        arr = data if data.flags.c_contiguous else np.ascontiguousarray(data)
        return arr.reshape(-1).view(np.uint8)
    if isinstance(data, torch.Tensor):
        return _as_bytes(data.detach().cpu().contiguous().numpy())
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
