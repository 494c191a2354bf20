"""The KV event stream: what hkv holds, in vLLM's wire format, for prefix-aware routers.

One publisher per metadata partition (each partition its own stream), on one thread of the
service process; the state view's residency feed (``core/kvevents.py``) says what changed::

    CacheState.poll_residency(feed)  -- under the lock: log entries -> BlockChanges
        -> KVEventBatch(ts, [AllBlocksCleared?, BlockStored | BlockRemoved ...], rank)
        -> PUB   (topic, seq u64 big-endian, msgpack payload)         port + 2i
           ROUTER  replay: a client sends (b"", seq u64 BE); it gets every buffered batch
                   with seq >= it as (b"", topic, seq, payload), then (b"", b"", -1, b"")
                                                                       port + 2i + 1

vLLM's ``ZmqEventPublisher`` is the model (``vllm/distributed/kv_events.py``): the same
frames, the same replay protocol, msgspec msgpack of the same structs (``EVENT_FORMS``: the
events as vLLM 0.32 encodes them, tagged maps, or as arrays, tag first, the form llm-d
reads by position: BlockStored [9] group_idx, [10] spec kind, [11] window; BlockRemoved [3]
group_idx).

Never slows the service: the writers only append to the state's bounded transition log (as
they always do); this thread reads it at its own pace. A publisher that falls behind the log
re-syncs (AllBlocksCleared, then every resident block), counted in ``stats``; ZMQ's PUB
drops for a subscriber past its high-water mark, and the replay buffer covers a reconnect.

Epochs: ``seq = epoch << 32 | n``, ``epoch`` the start time in tenths of a second, so a
restarted service's stream is told apart (``epoch_of(seq)``) and its seqs are still above
the old one's; its first batch is AllBlocksCleared, then every block it holds (none, or what
owners re-confirmed so far: re-confirms are stored as they land).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from hkv_service.core.kvevents import BlockChange, FeedBatch, ResidencyFeed
from hkv_service.core.layout import AT_BOUNDARY, Layout
from hkv_service.core.partitions import Partition
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Kind

from .tokenbook import TokenBook

__all__ = ["END_SEQ", "EventForm", "KvEventPublisher", "KvEventsConfig", "epoch_of",
           "spec_kind"]

log = logging.getLogger("hkv.kvevents")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # replay's end marker, as vLLM's
_EPOCH_BASE = 1_767_225_600  # 2026-01-01 UTC: tenths of a second since fit 32 bits to 2039
POLL_S = 0.02  # how long the thread waits on the replay socket when nothing changed
MAX_CHANGES = 4096  # log entries read per poll: bounds one lock hold

# vLLM's KVCacheSpecKind value per hkv kind; TAIL and INDEXER have no vLLM counterpart
# (a router should not count them as attention blocks of their own)
_SPEC_KIND = {Kind.COMPRESSED: "full_attention", Kind.SWA: "sliding_window",
              Kind.STATE: "mamba", Kind.TAIL: "unknown", Kind.INDEXER: "unknown"}


class EventForm(enum.StrEnum):
    MAP = "map"  # events as tagged maps: vLLM 0.32's own KVCacheEvent encoding
    ARRAY = "array"  # events as arrays, tag first: decoded by position (llm-d)


def _structs(array_like: bool) -> tuple[type[Any], type[Any], type[Any], type[Any]]:
    """vLLM's KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared, field for field
    (the events' later optional fields, locality/ownership/session, are left to defaults)."""

    class BlockStored(msgspec.Struct, tag=True, array_like=array_like, gc=False):
        block_hashes: list[bytes]
        parent_block_hash: bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(msgspec.Struct, tag=True, array_like=array_like, gc=False):
        block_hashes: list[bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(msgspec.Struct, tag=True, array_like=array_like, gc=False):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


EVENT_FORMS = {form: _structs(form is EventForm.ARRAY) for form in EventForm}


def spec_kind(kind: Kind) -> str:
    return _SPEC_KIND[kind]


def epoch_of(seq: int) -> int:
    """The stream epoch a seq belongs to: a restarted service's seqs have a new one."""
    return seq >> 32


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    host: str
    port: int  # partition i's PUB binds port + 2i, its replay ROUTER port + 2i + 1
    topic: str = "kv@hkv-p{partition}@hkv"  # {partition}: this partition's index
    form: EventForm = EventForm.MAP
    buffer_batches: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket (messages per subscriber)


class KvEventPublisher:
    """Publishes ``state``'s residency changes until :meth:`close`."""

    def __init__(self, state: CacheState, config: KvEventsConfig, tokens: TokenBook,
                 partition: Partition) -> None:
        self.state, self.config, self.tokens = state, config, tokens
        self.layout: Layout = state.layout
        self.topic = config.topic.format(partition=partition.index).encode()
        self.epoch = int((time.time() - _EPOCH_BASE) * 10) & 0xFFFFFFFF
        self.stats = {"batches": 0, "events": 0, "resyncs": 0, "log_dropped": 0,
                      "replays": 0}
        self._batch, self._stored, self._removed, self._cleared = EVENT_FORMS[config.form]
        self._encode = msgspec.msgpack.Encoder().encode
        self._n = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._feed = ResidencyFeed()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        try:
            self._pub.set_hwm(config.hwm)
            base = config.port + 2 * partition.index
            host = f"[{config.host}]" if ":" in config.host else config.host
            self.port = _bind(self._pub, host, base)
            self.replay_port = _bind(self._replay, host, base + 1 if config.port else 0)
        except BaseException:
            self._close_sockets()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hkv-kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.config.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.config.host}:{self.replay_port}"

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._step()
            except Exception:  # a bug here must not end the stream for good
                log.exception("KV event publisher step failed; going on")
                busy = False
            if not busy and self._replay.poll(int(POLL_S * 1000)):
                self._serve_replay()

    def _step(self) -> bool:
        batch = self.state.poll_residency(self._feed, MAX_CHANGES)
        if batch.cleared and batch.dropped:
            self.stats["resyncs"] += 1
            self.stats["log_dropped"] += batch.dropped
            log.warning("KV events fell %d transitions behind the log: re-synced (cleared, "
                        "then every resident block)", batch.dropped)
        events = self._events(batch)
        if not events:
            return False
        self.publish(events)
        return True

    def publish(self, events: list[Any]) -> int:
        """Send one batch; its seq."""
        seq = self.epoch << 32 | self._n
        self._n += 1
        payload = self._encode(self._batch(ts=time.time(), events=events,
                                           data_parallel_rank=0))
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.stats["batches"] += 1
        self.stats["events"] += len(events)
        return seq

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("a KV event replay request of %d frames: not (id, '', seq)",
                        len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.stats["replays"] += 1
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    # ---- changes -> vLLM events -----------------------------------------------------------

    def _events(self, batch: FeedBatch) -> list[Any]:
        out: list[Any] = [self._cleared()] if batch.cleared else []
        out.extend(self._event(c) for c in batch.changes)
        return out

    def _event(self, c: BlockChange) -> Any:
        if not c.stored:
            return self._removed(block_hashes=[c.span[-1]], medium=c.medium,
                                 group_idx=c.column)
        column = self.layout.columns[c.column]
        window = column.group.window if column.kind is Kind.SWA else None
        block_size = self.layout.lcm if column.kind in AT_BOUNDARY else column.group.block_size
        tokens = self.tokens.tokens(c.span) if len(c.span) * self.layout.hash_block == \
            block_size else []
        return self._stored(block_hashes=[c.span[-1]], parent_block_hash=c.parent,
                            token_ids=tokens, block_size=block_size, lora_id=None,
                            medium=c.medium, lora_name=None, extra_keys=None,
                            group_idx=c.column, kv_cache_spec_kind=_SPEC_KIND[column.kind],
                            kv_cache_spec_sliding_window=window)


def _bind(sock: zmq.Socket[Any], host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")
