"""Service bench: Lookup over gRPC against the in-process lookup and a bare gRPC echo.

A child process hosts the metadata service (127.0.0.1:0, reference spec, a 2,048-block prefix
committed), a twin of it with the lookup memo off, one with walk segments off too, and an echo
server (a generic
bytes-in/bytes-out handler, no protobuf at all); the clients run in this process, as inference
workers run apart from the service in production. Measured in the same run:

* latency p50/p99 of Lookup for 1- and 2,048-block prefixes (request pre-serialized, hashes
  packed as the client sends them, reply left as bytes: the service's cost plus transport),
  with handles (~5k packed handles for 2,048 blocks: a 113 KB reply) and match-only (tokens
  and downgrades, what a router asks), and through the typed client (plus decoding into core
  types). ``service`` repeats a lookup of an unchanged prefix, so from the third call on the
  lookup memo answers it (core/memo.py) and the reply is replayed; ``question`` is a new
  question over a cached document, as a worker asks it: 2,048 hashes whose last 16 the cache
  never held, a request never seen before on every call, on the service as deployed (the
  stop found by bisection, then answered from the document's memo, core/memo.py), beside the
  echo of the same request bytes (``echo_question``: new bytes on every call too);
  ``service_walk`` is the repeated lookup on a twin with the memo off, where every call walks
  over runs walked before and packs and encodes its match afresh, ``service_cold_walk`` on a
  twin with segments off too, where every call walks and packs block by block (a prefix
  never walked before); ``core_walk`` / ``core_cold_walk`` those walks in process, and
  ``servicer_walk_in_process`` the server's whole handler (request bytes to reply bytes) on
  the first in process. Beside them: the echo of the very same request bytes, and an echo
  that answers the same request with as many bytes as the Lookup reply (the transport floor
  of the exchange);
* throughput of 1-block lookups with 1 and 4 client threads, batched 16 per call, and
  ping-pong over the ``LookupStream`` bidi stream, against echo (unary and bidi) the same way;
  each pair is the best of three alternating runs; ``lookup1_extra_per_call_us`` is what a
  1-block lookup costs beyond an echo call, from those two rates.

The ``hot_root`` section (:mod:`.hot_root`) measures one system prompt under every request
with chains kept whole against chains split at fixed depth ranges (``range_blocks``): the
hottest partition's share of objects and of lookup time, and the split's own lookup cost.

The ``partitions`` section (:mod:`.partitions`) measures lookups/s and written objects/s over
1, 2 and 4 metadata partitions, each its own process, through ``PartitionedMetadata`` (and,
outside ``--quick``, over partitions that are Ray actors on a two-node cluster); its headline
rates and ratios to one partition are also under ``figures`` / ``baseline`` / ``ratios`` as
``partitions_*``.

The servers share one process (and GIL), the clients another: 4 client threads show the
server's GIL plus state-lock contention together. To tell the two apart, the service's state
view runs on a :class:`~.lockstats.TimedLock` (a little dearer than an RLock) and the bench reports,
for the 4-thread run where it was busiest, the fraction of wall time the one state lock was
held and the wait per acquisition: a lock held a small fraction of the time, rarely waited
for, is not what bounds the rate.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from multiprocessing.connection import Connection
from typing import Any

import grpc

from ..client import MetadataClient
from ..core.api import LookupRequest, StateConfig
from ..core.ids import BlockHash, ShardId
from ..core.state_view import CacheState
from ..proto_gen.hkv.v1 import hkv_pb2 as pb
from ..server.app import ServerConfig, Service, build_service
from ..server.servicer import MetadataServicer
from ..specs import default_spec
from ..testing import commit_prefix, pools_for, prompt_hashes, question
from ..wire.codec import encode_lookup
from . import hot_root as hot_root_bench
from . import partitions as partitions_bench
from .lockstats import LockStats, TimedLock
from .timing import percentile, samples

__all__ = ["run"]

SERVER_START_S = 120.0
COLD = StateConfig(memo_capacity=0, segment_blocks=0)  # nothing a walk did before is reused
QUESTION_BLOCKS = 16  # a new question's blocks past the cached document (never cached)
_LOOKUP = "/hkv.v1.MetadataService/Lookup"
_STREAM = "/hkv.v1.MetadataService/LookupStream"
_ECHO = "/bench.Echo/Echo"
_ECHO_STREAM = "/bench.Echo/EchoStream"
_REPLY = "/bench.Echo/Reply"
# request length -> what Reply answers: as many bytes as Lookup answers that request (set in
# the server process before it reports ready)
_REPLY_BYTES: dict[int, bytes] = {}


def _echo_server() -> tuple[grpc.Server, int]:
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda req, _ctx: req),
        "EchoStream": grpc.stream_stream_rpc_method_handler(lambda it, _ctx: it),
        "Reply": grpc.unary_unary_rpc_method_handler(
            lambda req, _ctx: _REPLY_BYTES.get(len(req), b"")),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo",
                                                                          handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _filled(n_blocks: int, config: StateConfig | None = None, lock: TimedLock | None = None
            ) -> tuple[CacheState, list[BlockHash]]:
    state = CacheState(default_spec(), config, lock=lock)
    state.register_owner(ShardId("s0"), pools_for(state.layout, n_blocks + 8))
    hashes = prompt_hashes(state.spec, n_blocks)
    commit_prefix(state, hashes)
    return state, hashes


def _service(n_blocks: int, config: StateConfig | None = None, lock: TimedLock | None = None
             ) -> tuple[Service, list[BlockHash]]:
    state, hashes = _filled(n_blocks, config, lock)
    service = build_service(ServerConfig(port=0), state)
    service.server.start()
    return service, hashes


def _ready(conn: Connection, proc: Any) -> tuple[int, int, int, int]:
    """The server process's ports, or a clear error if it died or hung on the way up."""
    deadline = time.monotonic() + SERVER_START_S
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"the bench's server process exited ({proc.exitcode}) before "
                               "serving; its traceback is above")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the bench's server process did not start in {SERVER_START_S} s")
    ports: tuple[int, int, int, int] = conn.recv()
    return ports


def _servers(n_blocks: int, conn: Connection) -> None:
    """The server process: the service over a filled state and the echo server; reports both
    ports, then serves until told to stop (or the bench process goes away), answering
    ``"lock"`` with the service's state-lock figures meanwhile."""
    lock = TimedLock()
    service, hashes = _service(n_blocks, lock=lock)
    walker, _ = _service(n_blocks, StateConfig(memo_capacity=0))  # every lookup walks
    cold, _ = _service(n_blocks, COLD)  # ... block by block
    echo_server, echo_port = _echo_server()
    try:
        for n in (1, n_blocks):
            payload = _batch_bytes([LookupRequest(hashes[:n])])
            reply = _unary(f"127.0.0.1:{service.port}", _LOOKUP, payload)()()
            _REPLY_BYTES[len(payload)] = bytes(len(reply))  # type: ignore[arg-type]
        conn.send((service.port, walker.port, cold.port, echo_port))
        with contextlib.suppress(EOFError, OSError):
            while conn.recv() == "lock":
                conn.send(lock.stats())
    finally:
        for s in (service, walker, cold):
            s.stop(0).wait(10)
        echo_server.stop(0).wait(10)


def _lock_stats(conn: Connection) -> LockStats:
    conn.send("lock")
    stats: LockStats = conn.recv()
    return stats


def _batch_bytes(requests: list[LookupRequest]) -> bytes:
    msg = pb.LookupBatchRequest()
    for r in requests:
        encode_lookup(r, msg.requests.add())
    return bytes(msg.SerializeToString())


def _stream_bytes(requests: list[LookupRequest]) -> bytes:
    msg = pb.LookupStreamRequest(tag=1)
    for r in requests:
        encode_lookup(r, msg.requests.add())
    return bytes(msg.SerializeToString())


def _interleaved(fns: dict[str, Callable[[], object]], count: int) -> dict[str, float]:
    """p50/p99 of each call, the calls taken in turn (one of each per round): a noisy
    neighbour then slows every figure alike instead of whichever block ran during it."""
    for fn in fns.values():  # warm up (the third identical lookup is the memo's first hit)
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(count):
        for name, fn in fns.items():
            times[name] += samples(fn, 1)
    out: dict[str, float] = {}
    for name, t in times.items():
        out[f"{name}_p50_s"], out[f"{name}_p99_s"] = percentile(t, 0.5), percentile(t, 0.99)
    return out


def _rps(make_call: Callable[[], Callable[[], object]], threads: int, per_thread: int,
         mark: Callable[[], object] | None = None) -> float:
    """Calls/s with ``threads`` client threads, each with its own channel, fixed count;
    ``mark`` is called as the calls start and once they all ended."""
    calls = [make_call() for _ in range(threads)]
    for c in calls:
        c()
    start = threading.Barrier(threads + 1)

    def work(call: Callable[[], object]) -> None:
        start.wait()
        for _ in range(per_thread):
            call()

    pool = [threading.Thread(target=work, args=(c,)) for c in calls]
    for t in pool:
        t.start()
    if mark is not None:  # outside the timed window (the threads wait at the barrier)
        mark()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    if mark is not None:
        mark()
    return threads * per_thread / elapsed


def _stub(endpoint: str, method: str) -> Any:
    """A unary bytes-in/bytes-out callable on its own channel."""
    channel = grpc.insecure_channel(endpoint, options=[
        ("grpc.max_receive_message_length", 64 << 20)])
    return channel.unary_unary(method)


def _unary(endpoint: str, method: str, payload: bytes) -> Callable[[], Callable[[], object]]:
    def make() -> Callable[[], object]:
        stub = _stub(endpoint, method)
        return lambda: stub(payload, timeout=30)
    return make


def _ping_pong_rps(endpoint: str, method: str, payload: bytes, count: int) -> float:
    """Request/response round trips per second over one bidi stream."""
    channel = grpc.insecure_channel(endpoint)
    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def requests() -> Iterator[bytes]:
        while (item := outbox.get()) is not None:
            yield item

    responses: Any = channel.stream_stream(method)(requests(), timeout=120)
    outbox.put(payload)
    next(responses)  # warm up
    t0 = time.perf_counter()
    for _ in range(count):
        outbox.put(payload)
        next(responses)
    elapsed = time.perf_counter() - t0
    outbox.put(None)
    responses.cancel()
    channel.close()
    return count / elapsed


def _questions(hashes: list[BlockHash], n: int, count: int) -> list[bytes]:
    """``count`` new questions over the cached document ``hashes[:n - QUESTION_BLOCKS]``,
    serialized: ``n`` hashes each, whose last ``QUESTION_BLOCKS`` the cache never held; no two
    the same (no reply is replayed)."""
    doc = hashes[: n - QUESTION_BLOCKS]
    return [_batch_bytes([LookupRequest(question(doc, i, QUESTION_BLOCKS))])
            for i in range(count)]


def _each(endpoint: str, method: str, payloads: list[bytes]) -> Callable[[], object]:
    """A call of ``method`` per invocation, each with the next of ``payloads``."""
    stub, it = _stub(endpoint, method), iter(payloads)
    return lambda: stub(next(it), timeout=30)


def _latencies(endpoint: str, walker: str, cold: str, echo: str,
               states: tuple[CacheState, CacheState], hashes: list[BlockHash], n: int,
               count: int) -> dict[str, float]:
    req = LookupRequest(hashes[:n])
    payload = _batch_bytes([req])
    svc, ech = _unary(endpoint, _LOOKUP, payload)(), _unary(echo, _ECHO, payload)()
    walk, cold_walk = _unary(walker, _LOOKUP, payload)(), _unary(cold, _LOOKUP, payload)()
    state, cold_state = states
    servicer = MetadataServicer(state)
    only = _unary(endpoint, _LOOKUP, _batch_bytes([LookupRequest(hashes[:n], handles=False)]))()
    reply = svc()
    sized = _unary(echo, _REPLY, payload)()
    assert isinstance(reply, bytes) and len(sized()) == len(reply) == len(walk())  # type: ignore[arg-type]
    assert len(cold_walk()) == len(reply)  # type: ignore[arg-type]
    with MetadataClient(endpoint, timeout_s=30) as client:
        fns: dict[str, Callable[[], object]] = {
            "service": svc, "service_walk": walk, "service_cold_walk": cold_walk,
            "match_only": only, "echo": ech, "echo_reply_sized": sized,
            "core_walk": lambda: state.lookup(req),
            "core_cold_walk": lambda: cold_state.lookup(req),
            # the server's handler on the in-process twin, request bytes to reply bytes
            "servicer_walk_in_process": lambda: servicer.LookupRaw(payload, None),
            "client": lambda: client.lookup(req)}
        if n > QUESTION_BLOCKS:  # warm-up: 3 calls, the second keeps the document's memo
            questions = _questions(hashes, n, count + 3)
            fns["question"] = _each(endpoint, _LOOKUP, questions)
            # the echo of the very same (each time new) request bytes
            fns["echo_question"] = _each(echo, _ECHO, questions)
        out = {f"lookup{n}_{k}": v for k, v in _interleaved(fns, count).items()}
    out[f"lookup{n}_request_bytes"] = float(len(payload))
    out[f"lookup{n}_reply_bytes"] = float(len(reply))
    return out


def _paired_best(ours: Callable[[], float], theirs: Callable[[], float], rounds: int = 3
                 ) -> tuple[float, float]:
    """Best of ``rounds`` alternating runs of each: a noisy neighbour then slows both sides
    alike instead of whichever happened to run during it."""
    a = b = 0.0
    for _ in range(rounds):
        a, b = max(a, ours()), max(b, theirs())
    return a, b


def _throughput(endpoint: str, echo: str, hashes: list[BlockHash], calls: int,
                lock_stats: Callable[[], LockStats]) -> dict[str, float]:
    one = [LookupRequest(hashes[:1])]
    single, batch16 = _batch_bytes(one), _batch_bytes(one * 16)
    out: dict[str, float] = {}
    out["lookups_per_s_1thread"], out["echo_rps_1thread"] = _paired_best(
        lambda: _rps(_unary(endpoint, _LOOKUP, single), 1, calls),
        lambda: _rps(_unary(echo, _ECHO, single), 1, calls))
    marks: list[LockStats] = []
    out["lookups_per_s_4threads"], out["echo_rps_4threads"] = _paired_best(
        lambda: _rps(_unary(endpoint, _LOOKUP, single), 4, calls // 4,
                     lambda: marks.append(lock_stats())),
        lambda: _rps(_unary(echo, _ECHO, single), 4, calls // 4))
    # the state lock over the 4-thread runs, the busiest of them: is it what bounds the rate?
    window = max((end.since(begin) for begin, end in zip(marks[::2], marks[1::2], strict=True)),
                 key=lambda w: w["held_fraction"])
    out.update({f"state_lock_{k}_4threads": v for k, v in window.items()})
    out["lookups_per_s_batched16"] = 16 * _rps(_unary(endpoint, _LOOKUP, batch16), 1,
                                               calls // 4)
    out["stream_lookups_per_s"], out["echo_stream_rps"] = _paired_best(
        lambda: _ping_pong_rps(endpoint, _STREAM, _stream_bytes(one), calls),
        lambda: _ping_pong_rps(echo, _ECHO_STREAM, _stream_bytes(one), calls))
    return out


def run(quick: bool = False) -> dict[str, Any]:
    n_blocks = 2048
    count, calls = (60, 600) if quick else (300, 3000)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with gRPC threads
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_servers, args=(n_blocks, child_conn), daemon=True)
    proc.start()
    try:
        port, walk_port, cold_port, echo_port = _ready(conn, proc)
        endpoint, echo = f"127.0.0.1:{port}", f"127.0.0.1:{echo_port}"
        walker, cold = f"127.0.0.1:{walk_port}", f"127.0.0.1:{cold_port}"
        # in-process twins that walk every time, for the core figures
        state, hashes = _filled(n_blocks, StateConfig(memo_capacity=0))
        states = (state, _filled(n_blocks, COLD)[0])
        lat = _latencies(endpoint, walker, cold, echo, states, hashes, 1, count)
        lat.update(_latencies(endpoint, walker, cold, echo, states, hashes, n_blocks,
                              count // 3))
        thr = _throughput(endpoint, echo, hashes, calls, lambda: _lock_stats(conn))
    finally:
        with contextlib.suppress(OSError):
            conn.send("stop")
        proc.join(20)
        if proc.is_alive():  # stop only what we started, by handle
            proc.kill()
            proc.join(5)
    # what one 1-block lookup costs beyond an echo call, end to end
    thr["lookup1_extra_per_call_us"] = 1e6 * (1 / thr["lookups_per_s_1thread"]
                                              - 1 / thr["echo_rps_1thread"])
    baseline_keys = [k for k in {**lat, **thr} if "echo" in k or "core" in k]
    merged = {**lat, **thr}
    figures = {k: v for k, v in merged.items() if k not in baseline_keys}
    baseline = {k: merged[k] for k in baseline_keys}
    ratios = {
        # the same request bytes repeated, prefix unchanged: a memo replay, not a walk (the
        # walk is lookup2048_walk_vs_echo_latency, the figure the target is about)
        "lookup2048_replay_vs_echo_latency":
            lat["lookup2048_service_p50_s"] / lat["lookup2048_echo_p50_s"],
        "lookup2048_replay_vs_reply_sized_echo_latency":
            lat["lookup2048_service_p50_s"] / lat["lookup2048_echo_reply_sized_p50_s"],
        "lookup2048_match_only_vs_echo_latency":
            lat["lookup2048_match_only_p50_s"] / lat["lookup2048_echo_p50_s"],
        "lookup1_vs_echo_latency": lat["lookup1_service_p50_s"] / lat["lookup1_echo_p50_s"],
        # a new question over a cached 2,032-block document, each call a request never seen
        # before: the miss bisected for, answered from the document's memo
        "lookup2048_question_vs_echo_latency":
            lat["lookup2048_question_p50_s"] / lat["lookup2048_echo_question_p50_s"],
        # walked and packed afresh every call, over runs walked before (memo off)
        "lookup2048_walk_vs_echo_latency":
            lat["lookup2048_service_walk_p50_s"] / lat["lookup2048_echo_p50_s"],
        # nothing reused: every block walked and packed one by one (memo and segments off)
        "lookup2048_cold_walk_vs_echo_latency":
            lat["lookup2048_service_cold_walk_p50_s"] / lat["lookup2048_echo_p50_s"],
        "lookup2048_walk_vs_core_walk_latency":
            lat["lookup2048_service_walk_p50_s"] / lat["lookup2048_core_walk_p50_s"],
        "lookups_per_s_vs_echo_rps": thr["lookups_per_s_1thread"] / thr["echo_rps_1thread"],
        "lookups_per_s_4threads_vs_echo_rps":
            thr["lookups_per_s_4threads"] / thr["echo_rps_4threads"],
        "lookups_per_s_4threads_vs_1thread":
            thr["lookups_per_s_4threads"] / thr["lookups_per_s_1thread"],
        "stream_lookups_per_s_vs_echo_stream_rps":
            thr["stream_lookups_per_s"] / thr["echo_stream_rps"],
        # the suggestion: a worker that looks up continuously streams its lookups;
        # against unary echo RPC/s (the stream-vs-stream figure above is the stricter one)
        "stream_lookups_per_s_vs_echo_rps":
            thr["stream_lookups_per_s"] / thr["echo_rps_1thread"],
    }
    parts = partitions_bench.run(quick)  # after the servers above are gone
    _headline_partitions(parts, figures, baseline, ratios)
    hot = hot_root_bench.run(quick)
    ratios.update({f"hot_root_{k}": v for k, v in hot["ratios"].items()})
    return {"name": "service", "quick": quick, "figures": figures, "baseline": baseline,
            "ratios": ratios, "partitions": parts, "hot_root": hot}


def _headline_partitions(parts: dict[str, Any], figures: dict[str, float],
                         baseline: dict[str, float], ratios: dict[str, float]) -> None:
    """The partitions section's rates and ratios, flat: one partition is the baseline."""
    for n, fig in parts["by_count"].items():
        for unit in partitions_bench.UNITS:
            (baseline if n == "1" else figures)[f"partitions_{unit}_{n}"] = fig[unit]
    ratios.update({f"partitions_{k}": v for k, v in parts["ratios"].items()})
