"""A write through the shared segment: its finish is made only once every byte is copied
(by the writer itself with ``worker_claims``; else posted to the shard, its answer read
later: workers/shared.py).
Adversarial: the writer is a real second process, stalled or SIGKILLed around its finish, the
shard a real one with its control socket; the reader this process, through the real mapping
and through the shard's own ``read_blocks``."""

from __future__ import annotations

import base64
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

from hkv_service.core.api import AllocRequest
from workers.control import ControlClient
from workers.inprocess import InProcessSystem
from workers.pool import HandleBatch
from workers.ports import ItemResult
from workers.shared import ORDERED, Mapped, SharedLink
from workers.shm import this_writer

pytestmark = pytest.mark.skipif(not ORDERED, reason="shared reads need x86-64 (TSO)")

# A worker on the shard's node: a real SharedLink (its link only tells where the segment is;
# every byte and every claim goes through the segment and the control socket). Reads
# (segment info, handles, mode) from stdin; writes 7s into every block.
#   stall:  its copy stops halfway (before any finish could be sent) and it sleeps
#   killed: it kills itself (SIGKILL) the moment its write returned (the finish posted)
WORKER = r"""
import base64, os, pickle, signal, sys, time
import numpy as np
import workers.shared as shared
from workers.link import Deferred
info, batch, nbytes, mode = pickle.loads(base64.b64decode(sys.stdin.readline()))

class Where:
    shard_id = "shard-0"
    def submit(self, method, *args, **kwargs):
        assert method == "shared_pool", method  # nothing else may go around the segment
        return Deferred(lambda _t: info)

if mode == "stall":
    def half_then_stall(self, batch, arrays, which):
        for i in which:
            slot, _, _, block, _ = batch.rows[i].tolist()
            r = self.pools[batch.columns[slot][3]]
            r.data[block, : nbytes // 2] = arrays[i][: nbytes // 2]
        print("half", flush=True)
        time.sleep(3600)
    shared.Mapped.write = half_then_stall

link = shared.SharedLink(Where())
res = link.submit("write_blocks", batch, arrays=[np.full(nbytes, 7, np.uint8)] * len(batch),
                  report=False).result(30)
assert all(r.ok for r in res), res
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(params=[True, False], ids=["worker claims", "shard claims"])
def one_shard(inprocess: Any, request: pytest.FixtureRequest) -> InProcessSystem:
    """A shard whose writers claim blocks themselves, or ask it (ShardConfig.worker_claims)."""
    system: InProcessSystem = inprocess(shards=1, blocks_per_group=8,
                                        worker_claims=request.param)
    return system


@pytest.fixture
def shard_claims(inprocess: Any) -> InProcessSystem:
    """A shard that makes every claim itself: its finishes are posted on its socket."""
    system: InProcessSystem = inprocess(shards=1, blocks_per_group=8, worker_claims=False)
    return system


@pytest.fixture
def worker() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(info: Any, batch: HandleBatch, nbytes: int, mode: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        assert proc.stdin is not None
        proc.stdin.write(base64.b64encode(pickle.dumps((info, batch, nbytes, mode))).decode()
                         + "\n")
        proc.stdin.flush()
        return proc

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _fresh(system: InProcessSystem, w: Any, seed: int) -> tuple[HandleBatch, int]:
    """One newly allocated SWA object (8 KiB) and its size."""
    hashes = w.prompt(1, seed=seed)
    allocs = system.meta.allocate(hashes, [AllocRequest(0, "swa")], None)
    assert not allocs[0].existing
    return HandleBatch.of([allocs[0].handle]), allocs[0].handle.nbytes


def _newer(batch: HandleBatch) -> HandleBatch:
    """The same block handed to another object at a newer generation (a reuse)."""
    rows = batch.rows.copy()
    rows[:, 1] += 1000  # object id
    rows[:, 2] += 1  # generation
    return HandleBatch(batch.columns, rows)


def _read(m: Mapped, system: InProcessSystem, batch: HandleBatch, nbytes: int
          ) -> tuple[bool, np.ndarray, Any]:
    """Whether the segment read kept bytes (and which), and the shard's own answer."""
    out = np.zeros(nbytes, np.uint8)
    kept = bool(m.read(batch, lambda i, n: out[:n])[0])
    answer = system.links["shard-0"].submit("read_blocks", batch).result(10)[0]
    return kept, out, answer


def test_a_writer_killed_before_its_finish_leaves_a_block_never_readable_and_reclaimed(
        one_shard: InProcessSystem, w: Any, worker: Any) -> None:
    """The writer's copy stalls halfway: its block is unreadable (through the segment and
    through the shard) and no newer object may take it while the writer lives; SIGKILLed,
    its half-copied bytes are still never readable, and the next write of the block takes it
    back and reads whole. (Mutation-checked: posting the finish before the copy made the
    half-written block readable.)"""
    shard = one_shard.links["shard-0"].shard
    info = shard.shared_pool()
    assert info is not None and info.control
    batch, nbytes = _fresh(one_shard, w, seed=11)
    proc = worker(info, batch, nbytes, "stall")
    assert proc.stdout.readline().strip() == "half"
    m = Mapped(info)
    me = this_writer()
    for _ in range(2):  # the writer stalled mid-copy, then dead
        kept, out, answer = _read(m, one_shard, batch, nbytes)
        assert not kept and not out.any(), "a half-written block was read"
        assert isinstance(answer, ItemResult) and not answer.ok, answer
        if proc.poll() is None:
            refused = shard.claim_blocks(_newer(batch), [nbytes], me)
            assert refused is not None and not refused[0].ok  # being written by a live process
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    # reclaimed: the next write of the block (a newer object) claims it, fills it, reads whole
    newer = _newer(batch)
    claims = shard.claim_blocks(newer, [nbytes], me)
    assert claims is not None and claims[0].ok, claims
    m.write(newer, [np.full(nbytes, 9, np.uint8)], [0])
    assert shard.finish_blocks(newer, me, report=False)[0].ok
    kept, out, answer = _read(m, one_shard, newer, nbytes)
    assert kept and (out == 9).all() and (answer == 9).all()
    assert not _read(m, one_shard, batch, nbytes)[0]  # the dead writer's object: never
    m.close()


def test_a_writer_killed_right_after_posting_its_finish_leaves_whole_bytes(
        one_shard: InProcessSystem, w: Any, worker: Any) -> None:
    """The finish leaves only once every byte is copied: a writer that dies with its finish
    in flight (its answer never read) leaves its block readable with all its bytes."""
    shard = one_shard.links["shard-0"].shard
    info = shard.shared_pool()
    assert info is not None
    batch, nbytes = _fresh(one_shard, w, seed=12)
    proc = worker(info, batch, nbytes, "killed")
    assert proc.wait(60) == -signal.SIGKILL
    m = Mapped(info)
    deadline = time.monotonic() + 10
    while not (got := _read(m, one_shard, batch, nbytes))[0]:
        assert time.monotonic() < deadline, "the posted finish was never taken"
        time.sleep(0.01)
    _, out, answer = got
    assert (out == 7).all() and (answer == 7).all()
    m.close()


def _write_with_the_finish_held(system: InProcessSystem, link: SharedLink, batch: HandleBatch,
                                data: np.ndarray) -> threading.Event:
    """``link`` writes ``data``; the shard is held busy from right after the copy, so the
    posted finish waits in the socket until the returned event is set."""
    shard = system.links["shard-0"].shard
    held, release = threading.Event(), threading.Event()

    def hold_the_shard() -> None:
        with shard._lock:
            held.set()
            release.wait(10)

    assert link.mapped is not None
    copy = link.mapped.write

    def copy_then_hold(*args: Any) -> None:
        copy(*args)
        threading.Thread(target=hold_the_shard, daemon=True).start()
        assert held.wait(10)

    link.mapped.write = copy_then_hold  # type: ignore[method-assign]
    assert all(r.ok for r in link.submit("write_blocks", batch, arrays=[data],
                                         report=False).result(10))
    assert link.control is not None and link.control.in_flight == 1  # sent, not taken yet
    return release


@pytest.mark.parametrize("reader", ["the writer", "another process"])
def test_a_read_of_a_block_whose_finish_is_in_flight_waits_for_it(
        shard_claims: InProcessSystem, w: Any, reader: str) -> None:
    """The shard is held busy right after the copy (the finish waits in the socket): a read
    of the block, by the writing process or by another one (its own connection, nothing in
    flight on it), waits for that finish and reads through the segment, never asking the
    shard (which could only answer STALE for a block still being written). (Mutation-checked:
    without the wait for a finish under way the other process's read went to the shard;
    without it and the writer's sync of its own finishes, the writer's too.)"""
    one_shard = shard_claims
    shard = one_shard.links["shard-0"].shard
    writer = SharedLink(one_shard.links["shard-0"])
    assert writer._attached() is not None and writer.control is not None
    other = SharedLink(one_shard.links["shard-0"])  # as another process: its own connection
    assert other._attached() is not None
    batch, nbytes = _fresh(one_shard, w, seed=13)
    data = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    release = _write_with_the_finish_held(one_shard, writer, batch, data)
    threading.Timer(0.05, release.set).start()
    reads_before = shard.stats()["counts"].get("reads", 0)
    link = writer if reader == "the writer" else other
    got = link.submit("read_blocks", batch).result(10)[0]
    assert not isinstance(got, ItemResult), got
    assert np.array_equal(got, data)
    assert shard.stats()["counts"].get("reads", 0) == reads_before  # the shard was not asked
    writer.control.sync(10)
    assert writer.control.in_flight == 0 and writer.control.refused == 0
    writer.close_mapping()
    other.close_mapping()


def test_calls_from_many_threads_and_posts_share_one_connection_in_order(
        shard_claims: InProcessSystem) -> None:
    """Answers go to the thread that asked, posted calls' answers are read in passing, a
    refused post is counted, never raised at someone else."""
    info = shard_claims.links["shard-0"].shard.shared_pool()
    assert info is not None
    client = ControlClient("shard-0", info.control)
    me = this_writer()
    empty = HandleBatch.of([])
    errors: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            for i in range(100):
                if i % 3 == 0:
                    client.post("release_blocks", empty, me)
                if i % 10 == k:
                    client.post("read_blocks", empty)  # not served: refused
                ticket = client.send("settle_blocks", empty, [], [], [])
                assert client.answer(ticket, 10) == []
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    client.sync(10)
    assert client.in_flight == 0 and client.refused == 3 * 10
    with pytest.raises(ValueError, match="not served"):
        client.call("read_blocks", empty)
    client.close()
