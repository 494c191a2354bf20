"""The demo's worker meeting a metadata-service outage recomputes with a reason, counted in
`fallbacks`; it never ends the run (issue 35, item 9).

Found on the system wiring (seed 91357, 3 runs of 6): while one worker's service_restart
fault had `hkv serve` down, the other worker's leased lookup met "connection refused" and the
run ended in a traceback with no report. Here the in-process wiring's real parts are kept, and
the demo's worker reaches the metadata view through a real gRPC server over that same view,
which the test stops and starts again on its port.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from hkv_service.client import MetadataClient
from hkv_service.core.errors import Unavailable
from hkv_service.demo.backend import DemoBackend
from hkv_service.demo.faults import FaultPlan
from hkv_service.demo.run import _shapes
from hkv_service.demo.wiring import InProcessWiring
from hkv_service.demo.worker import Totals, Worker
from hkv_service.demo.workload import long_prompt_workload
from hkv_service.refmodel import RefModel
from hkv_service.server.app import ServerConfig, Service, build_service
from hkv_service.specs import default_spec
from workers.dataplane import DataPlane
from workers.outage import OUTAGE_REASON

UP_WITHIN_S = 30.0
PREFIX = 640  # the shared document's tokens: whole resume points (the LCM is 128)


class GrpcFrontedWiring(InProcessWiring):
    """The in-process wiring whose worker side (lookups, allocations, commits) goes through
    a real gRPC service over the same metadata view; the shards keep their in-process port."""

    def __init__(self) -> None:
        super().__init__(default_spec(), 192)
        self.state = self.system.parts[0].state
        self.service = self._serve(0)
        self.meta = MetadataClient(f"127.0.0.1:{self.service.port}", timeout_s=2.0)
        self.dp = DataPlane(self.meta, self.system.links, timeout_s=15.0)

    def _serve(self, port: int) -> Service:
        service = build_service(ServerConfig(port=port), self.state)
        service.server.start()
        return service

    def stop_service(self) -> None:
        self.service.stop(0).wait()

    def start_service(self) -> None:
        """Serve again on the port, and return once this client's channel reaches it (it
        reconnects by itself, after a backoff of up to a second)."""
        self.service = self._serve(self.service.port)
        deadline = time.monotonic() + UP_WITHIN_S
        while True:
            try:
                self.meta.stats()
                return
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def close(self) -> None:
        try:
            self.meta.close()
            self.service.stop(0).wait()
        finally:
            super().close()


@pytest.fixture
def backend() -> Iterator[DemoBackend]:
    model = RefModel(default_spec())
    be = DemoBackend(GrpcFrontedWiring(), _shapes(model))
    yield be
    be.close()


def test_a_request_during_an_outage_recomputes_and_the_next_reuses(
        backend: DemoBackend) -> None:
    wiring = backend.wiring
    assert isinstance(wiring, GrpcFrontedWiring)
    model = RefModel(default_spec())
    worker = Worker(model, backend, FaultPlan({}, 0), check=True)
    cold, during, after = long_prompt_workload(PREFIX, 2, seed=5).requests
    totals = Totals()
    worker.run(cold, totals)  # computes the document and writes it back
    wiring.stop_service()
    # regression: the lookup raised Unavailable (connection refused) out of the worker
    worker.run(during, totals)
    wiring.start_service()
    worker.run(after, totals)
    rows = {r["rid"]: r for r in totals.per_request}
    assert rows[during.rid]["reused_tokens"] == 0
    assert OUTAGE_REASON.value in rows[during.rid]["reasons"]
    assert totals.fallbacks[OUTAGE_REASON.value] == 1
    assert rows[after.rid]["reused_tokens"] == PREFIX  # the service is back: so is reuse
    assert totals.checked == 3 and totals.silent_errors == 0
