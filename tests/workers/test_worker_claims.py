"""A worker on a shard's node claims the blocks it writes itself, under each pool's lock, in
the shard's shared records (``ShardConfig.worker_claims``, ``workers.pool.Slots``): a write
calls no other process. Adversarial: the same rules as the shard's own claims, a claimant
killed after any of its stores, a claimant stopped while it holds a pool's lock, and the
shard's reads racing a second process's claims and copies; the shard a real one, the second
process a real one mapping the real segment."""

from __future__ import annotations

import base64
import gc
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import workers.shm as shm
from hkv_service.core.api import AllocRequest
from workers.inprocess import InProcessSystem
from workers.pool import HandleBatch, Slots, StaleRead
from workers.ports import ItemResult, Outcome
from workers.shared import ORDERED, Mapped
from workers.shm import MetaLock, process_start, this_writer

pytestmark = pytest.mark.skipif(not ORDERED, reason="shared memory needs x86-64 (TSO)")

GROUP = "swa"


@pytest.fixture
def one_shard(inprocess: Any) -> InProcessSystem:
    system: InProcessSystem = inprocess(shards=1, blocks_per_group=8)
    return system


@pytest.fixture
def children() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start a Python child running ``code`` with ``payload`` on its stdin; killed after."""
    procs: list[subprocess.Popen[str]] = []

    def start(code: str, payload: Any = None) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        assert proc.stdin is not None
        proc.stdin.write(base64.b64encode(pickle.dumps(payload)).decode() + "\n")
        proc.stdin.flush()
        return proc

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _fresh(system: InProcessSystem, w: Any, seed: int) -> tuple[HandleBatch, int]:
    """One newly allocated SWA object and its size."""
    allocs = system.meta.allocate(w.prompt(1, seed=seed), [AllocRequest(0, GROUP)], None)
    assert not allocs[0].existing
    return HandleBatch.of([allocs[0].handle]), allocs[0].handle.nbytes


def _as(batch: HandleBatch, dgen: int = 0, doid: int = 0, block: int | None = None
        ) -> HandleBatch:
    """The same handle with another generation, object or block."""
    rows = batch.rows.copy()
    rows[:, 1] += doid
    rows[:, 2] += dgen
    if block is not None:
        rows[:, 3] = block
    return HandleBatch(batch.columns, rows)


def _dead_writer() -> tuple[int, int]:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(gone.pid)
    gone.wait()
    return gone.pid, start or 1


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _outcomes(results: list[ItemResult] | None) -> list[str]:
    assert results is not None
    return [r.outcome.name for r in results]


# -- the same rules as the shard's claims ----------------------------------------------------

def test_a_worker_claim_answers_what_the_shards_claim_answers(
        one_shard: InProcessSystem, w: Any) -> None:
    """Every case of the claim rules, made once by the shard (its control path) and once by
    this process in the mapped records, on blocks in the same state: the same outcome each
    time, and the shard sees a worker's claim as its own (a claim it then refuses)."""
    shard = one_shard.links["shard-0"].shard
    info = shard.shared_pool()
    assert info is not None and info.worker_claims
    m = Mapped(info)
    me = this_writer()
    other = _sleeper()
    them = (other.pid, process_start(other.pid) or 1)
    try:
        seen = {}
        for via, seed in (("shard", 1), ("worker", 2)):
            def claim(b: HandleBatch, n: int, who: tuple[int, int] = me) -> list[str]:
                if via == "shard":  # noqa: B023 (called in this iteration only)
                    return _outcomes(shard.claim_blocks(b, [n], who))
                return _outcomes(m.claim(b, [n], who, None, None))

            def finish(b: HandleBatch) -> list[str]:
                if via == "shard":  # noqa: B023
                    return _outcomes(shard.finish_blocks(b, me, report=False))
                return _outcomes(m.finish(b, me))

            a, n = _fresh(one_shard, w, seed)
            got = [claim(a, n), claim(a, n)]  # granted; granted again to its holder
            m.write(a, [np.full(n, 3, np.uint8)], [0])
            got += [finish(a), claim(a, n)]  # readable; its bytes never change
            got += [claim(_as(a, dgen=-1, doid=7), n)]  # an older generation
            got += [claim(_as(a, doid=7), n)]  # another object at the same generation
            got += [claim(_as(a, dgen=1, doid=7), n - 1)]  # a size not the object's
            got += [claim(_as(a, dgen=1, doid=7, block=10_000), n)]  # outside the pool
            b = _as(a, dgen=1, doid=7)
            got += [claim(b, n, them)]  # another live process claims the reused block
            got += [claim(_as(a, dgen=2, doid=8), n)]  # ... so no one else may
            got += [_outcomes(shard.claim_blocks(_as(a, dgen=2, doid=9), [n], me))]
            seen[via] = got
        assert seen["shard"] == seen["worker"], seen
        assert seen["worker"] == [["OK"], ["OK"], ["OK"], ["STALE"], ["STALE"], ["STALE"],
                                  ["FAILED"], ["FAILED"], ["OK"], ["STALE"], ["STALE"]]
    finally:
        other.kill()
        other.wait()
        m.close()


def test_a_worker_write_counts_and_reads_back_through_the_shard(
        one_shard: InProcessSystem, w: Any) -> None:
    """A write through the data plane claims and finishes in this process (the shard's
    counts say so: claims made, no call on its socket) and reads back whole both ways."""
    from workers.dataplane import DataPlane

    plane = DataPlane(one_shard.meta, one_shard.links)
    shard = one_shard.links["shard-0"].shard
    hashes = w.prompt(2, seed=5)
    blocks, tails = w.prefix_payload(plane.layout, 2, 5)
    assert plane.write_prefix(hashes, blocks, tails).ok
    counts = shard.stats()["counts"]
    assert counts.get("claims", 0) == counts.get("writes", 0) > 0
    link = plane.shards["shard-0"]
    assert link.control is None or link.control.in_flight == 0  # type: ignore[attr-defined]
    from hkv_service.core.api import LookupRequest
    from workers.dataplane import Recompute
    match = one_shard.meta.lookup(LookupRequest(hashes, lease_ttl_s=30.0))
    assert not isinstance(plane.read(match, hashes), Recompute)


# -- a claimant killed after any of its stores -----------------------------------------------

class _Recorder:
    """An array whose stores are logged in order (what ``Slots`` writes, and when)."""

    def __init__(self, name: str, arr: np.ndarray, log: list[tuple[str, Any, Any]]) -> None:
        self.name, self.arr, self.log = name, arr, log

    def __getitem__(self, key: Any) -> Any:
        return self.arr[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.log.append((self.name, key, value))
        self.arr[key] = value


def _stores(m: Mapped, step: Callable[[Slots], None]) -> list[tuple[str, Any, Any]]:
    """The stores ``step`` makes, in order, run on a private copy of the pool's records."""
    real = m.slots[GROUP]
    log: list[tuple[str, Any, Any]] = []
    names = ("seq", "generation", "object_id", "length", "claim_pid", "claim_start")
    meta = {f: _Recorder(f, getattr(real, f).copy(), log) for f in names}
    assert real.rows is not None
    rows = _Recorder("rows", np.array(real.rows), log)
    step(Slots(real.name, real.nbytes, meta, MetaLock(), rows))  # type: ignore[arg-type]
    return log


def _replay(m: Mapped, stores: list[tuple[str, Any, Any]]) -> None:
    real = m.slots[GROUP]
    with real.lock:
        for name, key, value in stores:
            getattr(real, name)[key] = value


def _readable(m: Mapped, system: InProcessSystem, b: HandleBatch, n: int
              ) -> tuple[bool, np.ndarray | None]:
    """Whether the segment read and the shard's read give ``b``'s bytes (they must agree)."""
    out = np.zeros(n, np.uint8)
    kept = bool(m.read(b, lambda i, k: out[:k])[0])
    answer = system.links["shard-0"].submit("read_blocks", b).result(10)[0]
    assert kept == (not isinstance(answer, ItemResult)), (kept, answer)
    if kept:
        assert np.array_equal(out, answer)
    return kept, out if kept else None


@pytest.mark.parametrize("phase", ["claim", "finish"])
def test_a_claimant_killed_after_any_store_leaves_no_wrong_bytes_and_its_block_reclaimed(
        one_shard: InProcessSystem, w: Any, phase: str) -> None:
    """The stores of a real claim (or finish), recorded in the order ``Slots`` makes them,
    are replayed one prefix at a time onto a block holding object A, as a claimant that was
    SIGKILLed right after them would leave it (x86-64 keeps stores in order). After every
    prefix: A reads whole or not at all, the claimed object B reads only once its finish
    made it whole, and the next write of the block (a newer object C) takes it back and
    reads whole. (Mutation-checked: a claim that sets the object before ``seq`` goes odd
    made B readable over A's bytes.)"""
    shard = one_shard.links["shard-0"].shard
    info = shard.shared_pool()
    assert info is not None
    m = Mapped(info)
    me, dead = this_writer(), _dead_writer()
    try:
        k, count = 0, None
        while count is None or k <= count:
            a, n = _fresh(one_shard, w, 40 + k)  # A, readable, in a block of its own
            assert _outcomes(m.claim(a, [n], me, None, None)) == ["OK"]
            m.write(a, [np.full(n, 5, np.uint8)], [0])
            assert _outcomes(m.finish(a, me)) == ["OK"]
            b = _as(a, dgen=1, doid=100)  # B: the block reused
            blk, gen, oid = int(b.rows[0, 3]), int(b.rows[0, 2]), int(b.rows[0, 1])
            claim = _stores(m, lambda s: s.claim(blk, gen, oid, n, dead))  # noqa: B023
            def claim_then_finish(s: Slots) -> None:
                s.claim(blk, gen, oid, n, dead)  # noqa: B023
                s.finish(blk, gen, oid, dead)  # noqa: B023
            both = _stores(m, claim_then_finish)
            finish = both[len(claim):]
            assert both[: len(claim)] == claim and finish, (claim, both)
            assert [st[0] for st in claim][:3] == ["claim_start", "claim_pid", "seq"], claim
            steps = claim if phase == "claim" else finish
            count = len(steps)
            stores = steps[:k] if phase == "claim" else claim + steps[:k]
            _replay(m, stores)
            if phase == "finish" or k == count:  # B's bytes were all copied
                m.pools[GROUP].data[blk, :n] = 9
            kept_a, out_a = _readable(m, one_shard, a, n)
            assert not kept_a or (out_a is not None and (out_a == 5).all()), \
                f"A read wrong bytes after {stores}"
            kept_b, out_b = _readable(m, one_shard, b, n)
            assert not kept_b or (phase == "finish" and out_b is not None
                                  and (out_b == 9).all()), \
                f"B read after {stores}"
            c = _as(a, dgen=2, doid=200)  # C: the next write of the block
            assert _outcomes(m.claim(c, [n], me, None, None)) == ["OK"], stores
            m.write(c, [np.full(n, 11, np.uint8)], [0])
            assert _outcomes(m.finish(c, me)) == ["OK"]
            kept_c, out_c = _readable(m, one_shard, c, n)
            assert kept_c and out_c is not None and (out_c == 11).all(), stores
            assert not _readable(m, one_shard, a, n)[0] and not _readable(m, one_shard, b, n)[0]
            k += 1
    finally:
        m.close()


# -- a claimant stopped while it holds a pool's lock --------------------------------------

HOLDER = r"""
import base64, pickle, sys, time
from workers.shared import Mapped
info, group = pickle.loads(base64.b64decode(sys.stdin.readline()))
m = Mapped(info)
m.slots[group].lock.__enter__()
print("held", flush=True)
time.sleep(3600)
"""


def test_a_worker_stopped_holding_a_pools_lock_fails_writes_there_and_never_hangs(
        one_shard: InProcessSystem, w: Any, children: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second process holds the SWA pool's lock and stops: the shard's own write there,
    a worker's claim there and the shard's reads of a readable object there fail with a
    sentence after the lock wait (no hang, nothing changed, no bytes served; a Ray read
    returns its items FAILED instead of raising out of the call); other pools are not held
    up; killed, the holder's lock goes with it and the same write goes through.
    (Mutation-checked: a blocking lock hung the shard's write; without the catch in the
    shard's read the MetaLockTimeout came out of read_blocks.)"""
    monkeypatch.setattr(shm, "LOCK_WAIT_S", 0.3)
    shard = one_shard.links["shard-0"].shard
    info = shard.shared_pool()
    assert info is not None
    r, rn = _fresh(one_shard, w, 52)  # readable before the pool is held
    assert shard.write_blocks(r, [np.full(rn, 6, np.uint8)], report=False)[0].ok
    holder = children(HOLDER, (info, GROUP))
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGSTOP)
    a, n = _fresh(one_shard, w, 50)
    data = np.full(n, 4, np.uint8)
    t0 = time.monotonic()
    res = shard.write_blocks(a, [data], report=False)
    assert not res[0].ok and "held them for over" in res[0].detail, res
    m = Mapped(info)
    claimed = m.claim(a, [n], this_writer(), None, None)
    assert claimed is not None and claimed[0].outcome is Outcome.FAILED, claimed
    assert time.monotonic() - t0 < 10
    assert not _readable(m, one_shard, a, n)[0]
    # a read of the held pool through the shard: its items fail, the call returns
    shard_read = one_shard.links["shard-0"].submit("read_blocks", r).result(10)[0]
    assert isinstance(shard_read, ItemResult) and "held them for over" in shard_read.detail
    blk, gen, oid = (int(x) for x in r.rows[0, [3, 2, 1]])
    with pytest.raises(shm.MetaLockTimeout):  # the disk tier's copy: refused, not served
        shard.pools[GROUP].read(blk, gen, oid)
    other = next(g for g in m.slots if g != GROUP)
    with m.slots[other].lock:  # another pool's lock is free
        pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert shard.write_blocks(a, [data], report=False)[0].ok
    kept, out = _readable(m, one_shard, a, n)
    assert kept and out is not None and (out == 4).all()
    m.close()


# -- the shard's reads race a second process's claims ------------------------------------

CHURNER = r"""
import base64, pickle, select, sys, time
import numpy as np
from workers.pool import HandleBatch
from workers.shared import Mapped
from workers.shm import this_writer
info, batch, n = pickle.loads(base64.b64decode(sys.stdin.readline()))
m, me = Mapped(info), this_writer()
print("ready", flush=True)
k = 0
while not select.select([sys.stdin], [], [], 0)[0]:  # until told to stop
    k += 1
    rows = batch.rows.copy()
    rows[:, 1] += k
    rows[:, 2] += k
    b = HandleBatch(batch.columns, rows)
    assert m.claim(b, [n], me, None, None)[0].ok
    blk = int(rows[0, 3])
    data = m.pools[batch.columns[0][3]].data
    data[blk, : n // 2] = k % 251   # half the new object's bytes, then a pause: a read of
    time.sleep(0.0005)              # the block now would mix two objects
    data[blk, n // 2 : n] = k % 251
    assert m.finish(b, me)[0].ok
    time.sleep(0.0005)  # (and time for whole reads)
print(k, flush=True)
"""


@pytest.mark.parametrize("reader", ["read_blocks", "offload"])
def test_the_shards_reads_never_mix_two_objects_while_a_worker_rewrites_the_block(
        one_shard: InProcessSystem, w: Any, children: Any, reader: str) -> None:
    """A second process claims the same block for object after object, copying each in
    two halves with a pause between. The shard meanwhile reads whichever object the block
    holds, through ``read_blocks`` (what a remote worker gets) and through its own copy for
    the disk tier (``BlockPool.read``): every read it serves is one object's bytes, whole.
    (Mutation-checked: without the lock and the second check around the shard's copy, reads
    came back mixed.)"""
    shard = one_shard.links["shard-0"].shard
    info = shard.shared_pool()
    assert info is not None
    a, n = _fresh(one_shard, w, 60)
    proc = children(CHURNER, (info, a, n))
    assert proc.stdout.readline().strip() == "ready"
    pool = shard.pools[GROUP]
    blk = int(a.rows[0, 3])
    served = mixed = tries = 0
    deadline = time.monotonic() + 60
    while (served < 300 or tries < 2000) and time.monotonic() < deadline:
        tries += 1
        gen, oid = int(pool.generation[blk]), int(pool.object_id[blk])
        b = _as(a, dgen=gen - int(a.rows[0, 2]), doid=oid - int(a.rows[0, 1]))
        k = oid - int(a.rows[0, 1])
        if reader == "read_blocks":
            got = one_shard.links["shard-0"].submit("read_blocks", b).result(10)[0]
            if isinstance(got, ItemResult):
                continue
        else:
            try:
                got = pool.read(blk, gen, oid, copy=False)
            except StaleRead:
                continue
        served += 1
        mixed += int(not (np.asarray(got) == k % 251).all())
    proc.stdin.write("stop\n")
    proc.stdin.flush()
    rounds = int(proc.stdout.readline())
    assert proc.wait(30) == 0
    assert rounds > 10 and served > 10, (rounds, served)
    assert mixed == 0, f"{mixed} of {served} reads mixed two objects' bytes"


@pytest.mark.parametrize("reader", ["read_blocks", "offload"])
def test_a_worker_claim_cannot_land_between_the_shards_check_and_its_copy(
        one_shard: InProcessSystem, w: Any, reader: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic: right before the shard's copy of a block (at its ``take`` for
    ``read_blocks``, after its ``check`` for its disk tier's copy), a worker tries to claim
    the block for a newer object and fill it. The shard holds the pool's lock from before its check
    until after its copy, so the claim fails and the shard serves the old object whole.
    (Mutation-checked: without that lock the claim landed and the read served 9s.)"""
    monkeypatch.setattr(shm, "LOCK_WAIT_S", 0.2)
    shard = one_shard.links["shard-0"].shard
    info = shard.shared_pool()
    assert info is not None
    m, me = Mapped(info), this_writer()
    a, n = _fresh(one_shard, w, 70)
    assert _outcomes(m.claim(a, [n], me, None, None)) == ["OK"]
    m.write(a, [np.full(n, 5, np.uint8)], [0])
    assert _outcomes(m.finish(a, me)) == ["OK"]
    pool = shard.pools[GROUP]
    b = _as(a, dgen=1, doid=100)
    landed: list[bool] = []

    def then_claim(checked: Any) -> Any:
        if not landed:
            got = m.claim(b, [n], me, None, None)
            landed.append(got is not None and got[0].ok)
            if landed[0]:
                m.write(b, [np.full(n, 9, np.uint8)], [0])
        return checked

    if reader == "read_blocks":
        real_take = pool.take
        monkeypatch.setattr(pool, "take", lambda *a_: then_claim(real_take(*a_)))
        got = one_shard.links["shard-0"].submit("read_blocks", a).result(10)[0]
    else:
        real_check = pool.check
        monkeypatch.setattr(pool, "check", lambda *a_: then_claim(real_check(*a_)))
        blk, gen, oid = (int(x) for x in a.rows[0, [3, 2, 1]])
        got = pool.read(blk, gen, oid, copy=False)
    assert landed == [False]
    assert not isinstance(got, ItemResult) and (np.asarray(got) == 5).all()
    m.close()


def test_threads_and_links_of_one_process_claim_side_by_side(
        one_shard: InProcessSystem, w: Any) -> None:
    """Four threads write fresh objects through two links of one process at once (each
    link its own open file, so its own OFD locks; the threads of a link share them and the
    pool's thread lock): every write is granted and finished, and every object reads back
    its own bytes through the segment and through the shard."""
    import concurrent.futures

    from hkv_service.core.states import Event
    from workers.commits import commit_many
    from workers.ports import Commit
    from workers.shared import SharedLink

    links = [SharedLink(one_shard.links["shard-0"]) for _ in range(2)]
    assert all(link._attached() is not None and link.mapped is not None
               and link.mapped.worker_claims for link in links)
    m = Mapped(one_shard.links["shard-0"].shard.shared_pool())
    lock = threading.Lock()  # (the allocations: one metadata view in process)

    def writer(t: int) -> list[tuple[HandleBatch, int, int]]:
        done = []
        for k in range(8):
            with lock:
                batch, n = _fresh(one_shard, w, 1000 + 100 * t + k)
            value = (7 * t + k) % 251
            res = links[t % 2].submit("write_blocks", batch,
                                      arrays=[np.full(n, value, np.uint8)]).result(10)
            assert res[0].ok, res
            kept, out = _readable(m, one_shard, batch, n)  # before the block is reused
            assert kept and out is not None and (out == value).all(), (t, k)
            done.append((batch, n, value))
            with lock:  # given back: the next allocation may reuse the block
                commit_many(one_shard.meta, [(batch[0], Commit((Event.EVICT,)))])
        return done

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        written = [x for f in [pool.submit(writer, t) for t in range(4)] for x in f.result()]
    assert len(written) == 32
    counts = one_shard.links["shard-0"].shard.stats()["counts"]
    assert counts.get("claims", 0) == counts.get("writes", 0) >= 32
    for link in links:
        link.close_mapping()
    m.close()


def test_a_process_holding_over_a_thousand_files_still_writes_and_reads(
        one_shard: InProcessSystem, w: Any) -> None:
    """A worker whose descriptors run past 1023 (an engine's process holds that many): the
    liveness checks of the shard and of a claimant ask ``poll``, which takes any descriptor.
    (Regression: with ``select`` a fresh-clone CI's stateful test, whose in-process shards
    come and go, failed with "filedescriptor out of range in select()".)"""
    import resource

    from workers.shared import SharedLink
    from workers.shm import writer_alive

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        if hard != resource.RLIM_INFINITY and hard < 1200:
            pytest.skip(f"this process may open {hard} files at most: too few to pass 1023")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    # a finalizer that runs meanwhile (a dropped mapping's pidfd, an earlier test's) would
    # free a low descriptor for the next open: collected first, none run until the end
    gc.collect()
    gc.disable()
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # what opens next: > 1023
    other = _sleeper()
    try:
        link = SharedLink(one_shard.links["shard-0"])
        assert link._attached() is not None and link.mapped is not None
        assert link.mapped.pidfd > 1023 and link.mapped.alive()
        assert writer_alive((other.pid, process_start(other.pid) or 1))
        batch, n = _fresh(one_shard, w, 90)
        res = link.submit("write_blocks", batch, arrays=[np.full(n, 3, np.uint8)]).result(10)
        assert res[0].ok, res
        got = link.submit("read_blocks", batch).result(10)[0]
        assert not isinstance(got, ItemResult) and (got == 3).all()
        link.close_mapping()
    finally:
        other.kill()
        other.wait()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        gc.enable()


def _pidfds() -> int:
    out = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            out += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            continue
    return out


def test_a_mapping_dropped_without_closing_leaves_no_descriptor(
        one_shard: InProcessSystem) -> None:
    """Links (and their mappings) dropped without ``close_mapping``, as a data plane thrown
    away is: once collected, none of their descriptors stays open. (Regression: each left its
    pidfd open for good; a test run gathered ~1,000.)"""
    import gc

    from workers.shared import SharedLink

    gc.collect()
    before = _pidfds()
    for _ in range(20):
        link = SharedLink(one_shard.links["shard-0"])
        assert link._attached() is not None
        del link
    gc.collect()
    assert _pidfds() - before <= 1, "pidfds of dropped mappings are still open"
