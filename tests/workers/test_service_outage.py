"""A worker meeting a metadata-service outage recomputes, with a reason; it never crashes
(issue 35, item 9).

Found by the system demo's service_restart fault: a leased lookup met the restarting
`hkv serve` (UNAVAILABLE: connection refused; a leased lookup is not retried) and the run
ended in a traceback. Here a real gRPC service (the in-process server `hkv serve` runs) is
stopped under an `attach`-style worker whose real shards reach it over gRPC too, then started
again on its port with a fresh view, as a restart does.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hkv_service.client import MetadataClient, RpcFailed
from hkv_service.core.errors import InvalidInput, OwnerLost, Unavailable
from hkv_service.core.funnel import LookupRequest
from hkv_service.core.ids import BlockHash
from hkv_service.core.layout import Layout
from hkv_service.core.state_view import CacheState
from hkv_service.server.app import SERVICE_NAME, ServerConfig, Service, build_service
from hkv_service.specs import default_spec
from hkv_service.testing import prompt_hashes
from workers.attach import Worker
from workers.dataplane import DataPlane, Recompute
from workers.link import InProcessLink
from workers.outage import OUTAGE_REASON, is_outage, lookup
from workers.ports import Outcome
from workers.shard import ShardActor, ShardConfig

SHARDS = ("shard-0", "shard-1")
BLOCKS = 6  # hash blocks of the prompt
BACK_WITHIN_S = 60.0  # the shards rejoin at their next heartbeat (0.2 s apart)


def _serve(port: int) -> Service:
    service = build_service(ServerConfig(port=port), CacheState(default_spec()))
    service.server.start()
    return service


@dataclass
class Rig:
    service: Service
    links: dict[str, InProcessLink] = field(default_factory=dict)
    plane: DataPlane | None = None

    @property
    def worker(self) -> Worker:
        assert self.plane is not None
        spec = default_spec()
        return Worker(self.plane.meta, self.plane, spec, Layout(spec))

    def stop_service(self) -> None:
        self.service.stop(0).wait()

    def start_service(self) -> None:
        """A fresh view on the same port, as `hkv up` restarts `hkv serve`."""
        self.service = _serve(self.service.port)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    rig = Rig(_serve(0))
    endpoint = f"127.0.0.1:{rig.service.port}"
    meta = MetadataClient(endpoint, timeout_s=2.0)
    try:
        for sid in SHARDS:  # real shards, reaching the service over gRPC as a worker does
            cfg = ShardConfig(sid, endpoint, str(tmp_path), blocks_per_group=64,
                              heartbeat_interval_s=0.2, device="cpu", metadata_timeout_s=2.0)
            rig.links[sid] = InProcessLink(sid, ShardActor(cfg))
        rig.plane = DataPlane(meta, rig.links, 5.0)
        yield rig
    finally:
        for link in rig.links.values():
            link.close()
        meta.close()
        rig.service.stop(0).wait()


def _prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, BLOCKS * 64 + 10)


def _write(rig: Rig, tokens: np.ndarray, w: Any) -> Any:
    """Write every block of the prompt's hashes (bytes made up by the helper)."""
    hashes = rig.worker.hashes(tokens)
    blocks, tails = w.prefix_payload(rig.worker.layout, len(hashes), seed=len(tokens))
    return rig.worker.plane.write_prefix(hashes, blocks, tails)


def _reuse_comes_back(rig: Rig, tokens: np.ndarray) -> int:
    """Look up until the shards have rejoined and re-confirmed what they hold."""
    deadline = time.monotonic() + BACK_WITHIN_S
    while True:
        _, m = rig.worker.lookup(tokens)
        rig.worker.plane.read(m, rig.worker.hashes(tokens))  # releases its lease
        if m.usable_tokens or time.monotonic() > deadline:
            return m.usable_tokens
        time.sleep(0.1)


def test_lookup_during_an_outage_is_a_recompute_and_the_next_one_reuses(rig: Rig,
                                                                          w: Any) -> None:
    tokens = _prompt(0)
    assert _write(rig, tokens, w).ok
    _, before = rig.worker.lookup(tokens)
    assert before.usable_tokens > 0
    rig.worker.plane.read(before, rig.worker.hashes(tokens))
    rig.stop_service()
    # regression: a leased lookup raised Unavailable (connection refused) out of the worker
    hashes, m = rig.worker.lookup(tokens)
    assert m.usable_tokens == 0 and m.lease_id is None
    assert [d.reason for d in m.downgrades] == [OUTAGE_REASON]
    assert rig.worker.plane.read(m, hashes) == {}  # nothing to read: the prompt is computed
    rig.start_service()
    assert _reuse_comes_back(rig, tokens) == before.usable_tokens


def test_read_and_write_during_an_outage_never_raise(rig: Rig, w: Any) -> None:
    tokens, fresh = _prompt(1), _prompt(2)
    written = _write(rig, tokens, w)
    hashes, m = rig.worker.lookup(tokens)
    rig.stop_service()
    # memory copies are the shards' own: the read re-checks them there (its lease release
    # fails quietly) and gives the bytes that were written
    got = rig.worker.plane.read(m, hashes)
    assert not isinstance(got, Recompute) and sum(map(len, got.values())) > 0
    # a write is allocated at the service: every item fails, nothing is half written
    report = _write(rig, fresh, w)
    assert report.written == 0 and report.failed and not report.handles
    assert {r.outcome for r in report.failed.values()} == {Outcome.FAILED}
    rig.start_service()
    assert _reuse_comes_back(rig, tokens) > 0
    again = _write(rig, fresh, w)
    assert again.ok and again.written == len(report.failed)
    assert written.ok


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _stalled_service() -> Iterator[str]:
    """A gRPC server that takes every Lookup and never answers it (a service stuck)."""
    release = threading.Event()

    def stall(_request: bytes, _context: Any) -> bytes:
        release.wait(30.0)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE_NAME, {"Lookup": grpc.unary_unary_rpc_method_handler(stall)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        release.set()
        server.stop(0).wait()


def _lookup_error(endpoint: str) -> Exception:
    with MetadataClient(endpoint, timeout_s=0.5) as c:
        try:
            c.lookup(LookupRequest(_hashes(), 64, lease_ttl_s=5.0))
        except Exception as exc:
            return exc
    raise AssertionError("the lookup was answered")


def test_what_an_outage_is() -> None:
    refused = _lookup_error(f"127.0.0.1:{_free_port()}")  # nothing listens
    assert isinstance(refused, Unavailable) and is_outage(refused)
    with socket.socket() as mute:  # a listener that never speaks HTTP/2
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        unanswered = _lookup_error(f"127.0.0.1:{mute.getsockname()[1]}")
    assert is_outage(unanswered), unanswered
    with _stalled_service() as endpoint:  # takes the call, never answers it
        late = _lookup_error(endpoint)
    assert isinstance(late, RpcFailed) and late.code == "DEADLINE_EXCEEDED"
    assert is_outage(late)
    assert not is_outage(OwnerLost("shard-0 is gone"))  # an answer, not an absence
    assert not is_outage(RpcFailed("UNAUTHENTICATED", "no token"))


def test_an_answer_that_is_not_an_outage_is_raised() -> None:
    service = _serve(0)
    try:
        with MetadataClient(f"127.0.0.1:{service.port}", timeout_s=2.0) as c:
            bad = LookupRequest(_hashes(), 64 * 40)  # beyond the hashes
            with pytest.raises(InvalidInput):
                lookup(c, bad)
    finally:
        service.stop(0).wait()


def _hashes() -> list[BlockHash]:
    return prompt_hashes(default_spec(), 2, 0)
