"""Linearizability, etcd-robustness style: 8 client threads fire random transitions (legal and
illegal, some compare-and-set) at shared objects through a real server while an owner restarts;
the recorded history of acknowledged transitions must replay through the transition table as a
sequential model: per object, acknowledged results carry consecutive sequence numbers, and each
state is exactly what the table gives for the previous one."""

from __future__ import annotations

import random
import threading
from collections import defaultdict

from svc_util import Live, hashes, register

from hkv_service.client import MetadataClient
from hkv_service.core.api import AllocRequest, Params
from hkv_service.core.errors import HkvError
from hkv_service.core.states import TERMINAL_STATES, Event, Kind, State
from hkv_service.core.transitions import TABLE

THREADS, OPS = 8, 200  # (no event rewrites a ready object's bytes: fewer are legal)
EVENTS = {
    Kind.COMPRESSED: [Event.BEGIN_WRITE, Event.WRITE_DONE, Event.INDEXER_SYNC],
    Kind.SWA: [Event.WRITE_DONE, Event.BEGIN_WRITE, Event.TAIL_DONE],
    Kind.TAIL: [Event.TAIL_APPEND, Event.TAIL_DONE, Event.WRITE_DONE],
    Kind.INDEXER: [Event.WRITE_DONE, Event.INDEXER_SYNC, Event.BEGIN_WRITE],
}


def test_history_replays_through_the_table(live: Live, client: MetadataClient) -> None:
    register(client, "s0")
    register(client, "s1")
    objects = {}  # object id -> (kind, column)
    for seed in range(6):
        hs = hashes(4, seed=seed)
        reqs = [AllocRequest(d, c) for d in (1, 3) for c in ("c4", "swa", "idx", "c4.tail")]
        for r, a in zip(reqs, client.allocate(hs, reqs), strict=True):
            objects[a.handle.object_id] = (a.handle.kind, r.column)
    ids = sorted(objects)
    history: list[tuple[int, Event, int, State]] = []  # (object, event, seq, state) acked
    lock = threading.Lock()

    def worker(t: int) -> None:
        rng = random.Random(t)
        with MetadataClient(live.endpoint, timeout_s=10.0) as c:
            for _ in range(OPS):
                oid = rng.choice(ids)
                kind, _col = objects[oid]
                event = Event.EVICT if rng.random() < 0.02 else rng.choice(EVENTS[kind])
                params = Params(version=rng.randint(0, 3), lo=None, hi=None,
                                tail_len=rng.randint(1, 4),
                                expect_seq=rng.choice([None, rng.randint(0, 3)]))
                try:
                    res = c.transition(oid, event, params)
                except HkvError:
                    continue  # refused: must have changed nothing (checked by the replay)
                with lock:
                    history.append((oid, event, res.seq, res.state))

    def restarter() -> None:
        with MetadataClient(live.endpoint, timeout_s=10.0) as c:
            for _ in range(2):
                threading.Event().wait(0.05)
                register(c, "s1")  # owner restart: its objects are LOST, outside the history

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    threads.append(threading.Thread(target=restarter))
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a client hung"

    per_object: dict[int, list[tuple[int, Event, State]]] = defaultdict(list)
    for oid, event, seq, st in history:
        per_object[oid].append((seq, event, st))
    assert len(history) > 50, f"only {len(history)} transitions acknowledged"
    assert len(per_object) > len(ids) // 2
    assert live.state.stats()["events"].get("owner_lost", 0) >= 2  # type: ignore[union-attr]
    for oid, ops in per_object.items():
        ops.sort(key=lambda op: op[0])
        kind = objects[oid][0]
        assert [seq for seq, _, _ in ops] == list(range(1, len(ops) + 1)), (
            f"object {oid}: acknowledged sequence numbers {[s for s, _, _ in ops]} are not "
            "consecutive: two writers won the same step or an ack was lost")
        state = State.ALLOCATED
        for seq, event, after in ops:
            assert TABLE[kind].get((state, event)) is after, (
                f"object {oid} step {seq}: {state.value} --{event.value}--> {after.value} "
                "is not what the table gives")
            assert state not in TERMINAL_STATES
            state = after
        live_rec = live.state.objects.get(oid)
        if live_rec is not None:  # the view's final state is the replay's (or a later LOST)
            assert live_rec.state is state or live_rec.state in TERMINAL_STATES
