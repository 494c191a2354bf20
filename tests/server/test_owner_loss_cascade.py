"""Regression (issue 19): losing one owner held the state lock for the whole of its objects
(16 s at 8M), the other owners' heartbeats waited behind it and they were expired too: the
cache went from 8M objects to 0. Now the loss is O(1) and the service reaps in slices.

Scaled to CI: one owner with ~40k objects (burying them all at once holds the lock ~1 s here),
seven more heartbeating over gRPC every 50 ms against a 0.5 s timeout, the service's own
expiry and reaper threads running. Only the lost owner may end up lost.
"""

from __future__ import annotations

import threading
import time

from svc_util import start_live

from hkv_service.client import MetadataClient
from hkv_service.core.api import StateConfig
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.server.serve import start_maintenance
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

VICTIM = ShardId("victim")
HEALTHY = [ShardId(f"healthy-{i}") for i in range(7)]
VICTIM_OBJECTS = 40_000
TIMEOUT_S = 0.5
BEAT_S = 0.05


def _fill(state: CacheState) -> int:
    seed = 0
    while len(state.objects) < VICTIM_OBJECTS:
        commit_prefix(state, prompt_hashes(state.spec, 64, seed=seed), owner=VICTIM)
        seed += 1
    return len(state.objects)


def _beat(client: MetadataClient, owner: ShardId, inc: int, stop: threading.Event,
          refused: list[ShardId]) -> None:
    while not stop.wait(BEAT_S):
        try:
            client.heartbeat(owner, inc)
        except Exception:  # UnknownOwner: this healthy owner was expired
            refused.append(owner)
            return


def test_losing_one_big_owner_expires_no_healthy_owner() -> None:
    state = CacheState(default_spec(), StateConfig(heartbeat_timeout_s=TIMEOUT_S))
    state.register_owner(VICTIM, pools_for(state.layout, 16_384))
    held = _fill(state)
    live = start_live(state=state)
    maintenance = start_maintenance(state, live.service)
    stop, refused = threading.Event(), []
    clients = [MetadataClient(live.endpoint, timeout_s=30.0) for _ in HEALTHY]
    beats: list[threading.Thread] = []
    try:
        for client, owner in zip(clients, HEALTHY, strict=True):
            inc = client.register_owner(owner, pools_for(state.layout, 64))
            beats.append(threading.Thread(target=_beat, args=(client, owner, inc, stop, refused),
                                          daemon=True))
        state.heartbeat(VICTIM, state.owners[VICTIM].incarnation)
        for t in beats:
            t.start()
        time.sleep(4 * BEAT_S)
        assert clients[0].mark_owner_lost(VICTIM) == held  # what the data plane sends
        deadline = time.monotonic() + 120.0
        while state.stats()["gauges"]["owners_reaping"] and time.monotonic() < deadline:  # type: ignore[index]
            time.sleep(0.05)
        time.sleep(2 * TIMEOUT_S + 1.0)  # the expiry loop (every 1 s) has looked again since
        liveness = state.owner_liveness()
    finally:
        stop.set()
        maintenance.set()
        for t in beats:  # before the clients close: a heartbeat in flight on a closed
            if t.ident is not None:  # channel fails, read as an expiry (a flake, 2026-12-03)
                t.join(10)
        for c in clients:
            c.close()
        live.service.stop(0).wait()
    assert state.object_count() == 0  # all of the lost owner's objects were buried
    assert refused == []
    assert liveness == {VICTIM: False, **dict.fromkeys(HEALTHY, True)}
