"""workers/shm.py + workers/shared.py: a shard's pools in shared memory, read and written by a
worker with one copy. Adversarial: the owner is a real second process (SIGKILLed, racing
writes), the worker side is the real :class:`~workers.shared.Mapped` and the data plane."""

from __future__ import annotations

import base64
import gc
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hkv_service.core.api import LookupRequest
from workers.dataplane import DataPlane, Recompute
from workers.inprocess import InProcessSystem
from workers.pool import HandleBatch, PoolSet, StaleRead, StaleWrite
from workers.shared import ORDERED, Mapped, NotShared, SharedLink
from workers.shm import process_start, writer_alive

pytestmark = pytest.mark.skipif(not ORDERED, reason="shared reads need x86-64 (TSO)")

BIG = 4 << 20  # a block large enough that copies overlap the other side's writes

# The owner: a real pool set in its own process. Prints its segment's info, then either
# rewrites block 0 forever (each time a new generation and object whose bytes are all
# ``object id % 256``, as a block evicted and reused), or idles.
OWNER = r"""
import base64, pickle, sys, time
import numpy as np
from workers.pool import PoolSet
pools = PoolSet({"c": %(nbytes)d}, 2, "cpu", shared=True)
pool = pools["c"]
pool.write(0, 1, np.full(%(nbytes)d, 1, np.uint8), 1)
print(base64.b64encode(pickle.dumps(pools.segment.info(1))).decode(), flush=True)
k = 1
while sys.argv[1] == "rewrite":
    k += 1
    pool.write(0, k, np.full(%(nbytes)d, k %% 256, np.uint8), k)
time.sleep(3600)
"""


@pytest.fixture
def owner() -> Iterator[Callable[[str, int], tuple[subprocess.Popen[str], Any]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(mode: str, nbytes: int = BIG) -> tuple[subprocess.Popen[str], Any]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.Popen([sys.executable, "-c", OWNER % {"nbytes": nbytes}, mode],
                                stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        assert proc.stdout is not None
        return proc, pickle.loads(base64.b64decode(proc.stdout.readline()))

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _batch(gen: int, oid: int, block: int = 0) -> HandleBatch:
    return HandleBatch((("s", 0, None, "c", BIG, 0),),  # type: ignore[arg-type]
                       np.array([[0, oid, gen, block, 0]], dtype=np.int64))


def _mapped_inodes() -> set[int]:
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "hkv-pool" in line}


def test_a_read_racing_rewrites_of_its_block_never_returns_mixed_bytes(owner: Any) -> None:
    """The owner evicts and reuses block 0 as fast as it can; the reader reads it under the
    identity it last saw there (as a lookup would hand out). Every read the seqlock keeps is
    one object's bytes whole; the others are discarded. (Mutation-checked: without the
    re-check after the copy, kept reads hold two objects' bytes within a second.)"""
    _, info = owner("rewrite")
    m = Mapped(info)
    region = m.pools["c"]
    kept = discarded = 0
    out = np.empty(BIG, np.uint8)
    # bounded, and long enough that a read wins the race on 2 loaded cores (a CI run once
    # kept none of 646,617 in 3 s: the owner rewrote faster than this reader was scheduled)
    start = time.monotonic()
    while (kept < 20 or discarded < 20) and time.monotonic() - start < (
            15.0 if not (kept and discarded) else 3.0):
        gen, oid = int(region.generation[0]), int(region.object_id[0])
        ok = m.read(_batch(gen, oid), lambda i, n: out[:n])
        if not ok[0]:
            discarded += 1
            continue
        kept += 1
        assert out[0] == oid % 256 and (out == out[0]).all(), \
            f"object {oid}'s read holds bytes {np.unique(out)[:8]}"
    assert kept and discarded, (kept, discarded)  # the race was run both ways
    m.close()


def test_a_sigkilled_owner_frees_its_segment_and_is_never_read(owner: Any) -> None:
    proc, info = owner("idle", 1 << 20)
    m = Mapped(info)
    out = np.empty(1 << 20, np.uint8)
    assert m.read(_batch(1, 1), lambda i, n: out[:n])[0] and (out == 1).all()
    assert m.inode in _mapped_inodes()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not m.alive()
    out[:] = 0
    assert not m.read(_batch(1, 1), lambda i, n: out[:n])[0]  # its bytes are not served
    assert not out.any()
    m.close()
    # nothing holds the memfd any more: not this process's mappings, not the dead owner
    assert m.inode not in _mapped_inodes()
    assert not Path(f"/proc/{info.pid}/fd/{info.fd}").exists()
    with pytest.raises(NotShared):  # a worker cannot attach to it again either
        Mapped(info)


def test_a_live_writers_claim_keeps_its_block_from_reuse_until_it_dies() -> None:
    """A worker claimed a block and stalls mid-copy: no newer write or claim may take the
    block while it lives (its copy could land in the reused block); once it is dead its
    half-copied bytes are no object's and the block is free. (Mutation-checked: ignoring
    the claim holder's liveness lets the reuse through.)"""
    pools = PoolSet({"c": 4096}, 2, "cpu", shared=True)
    pool = pools["c"]
    stalled = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        start = process_start(stalled.pid)
        assert start is not None
        writer = (stalled.pid, start)
        pool.claim(0, 1, 11, 4096, writer)
        assert pool.seq[0] % 2 == 1  # being written: unreadable to a seqlock reader
        with pytest.raises(StaleWrite, match="being written"):
            pool.write(0, 2, np.full(4096, 2, np.uint8), 12)
        with pytest.raises(StaleWrite, match="being written"):
            pool.claim(0, 2, 12, 4096, (os.getpid(), process_start(os.getpid()) or 0))
    finally:
        stalled.kill()
        stalled.wait()
    assert not writer_alive(writer)
    pool.write(0, 2, np.full(4096, 2, np.uint8), 12)
    assert (pool.read(0, 2, 12) == 2).all() and pool.seq[0] % 2 == 0
    with pytest.raises(StaleWrite):  # the dead writer's claim is gone
        pool.finish(0, 1, 11, writer)
    pools.segment.close()  # type: ignore[union-attr]


@pytest.fixture
def one_shard(inprocess: Any) -> InProcessSystem:
    system: InProcessSystem = inprocess(shards=1, blocks_per_group=16)
    return system


def test_the_data_plane_copies_through_the_segment_and_drops_a_replaced_shards(
        one_shard: InProcessSystem, w: Any) -> None:
    """Writes claim and fill blocks in the segment, reads never call the shard; a shard
    replaced by its successor is let go of: the old match is a recompute, never its bytes,
    and the old segment is no longer mapped."""
    system = one_shard
    plane = DataPlane(system.meta, system.links)
    link = plane.shards["shard-0"]
    assert isinstance(link, SharedLink)
    hashes = w.prompt(3, seed=5)
    blocks, tails = w.prefix_payload(plane.layout, 3, 5)
    assert plane.write_prefix(hashes, blocks, tails).ok
    match = system.meta.lookup(LookupRequest(hashes, lease_ttl_s=30.0))
    out = plane.read(match, hashes, release=False)
    assert not isinstance(out, Recompute)
    payload = {**blocks, **{k: v[0] for k, v in tails.items()}}
    for col, arrays in out.items():
        depths = plane.layout.needed_depths(plane.layout.by_name[col], match.usable_tokens)
        assert [a.tobytes() for a in arrays] == [payload[(d, col)].tobytes() for d in depths]
    counts = system.links["shard-0"].shard.stats()["counts"]
    assert counts.get("claims", 0) == len(payload) and counts.get("reads", 0) == 0
    old = link.mapped
    assert old is not None and old.inode in _mapped_inodes()
    system.kill_shard("shard-0")
    assert not old.alive()
    again = plane.read(match, hashes)
    assert isinstance(again, Recompute), again
    assert link.mapped is not old and old.pidfd < 0  # let go of
    # (in process the dead shard object maps it too, until it is collected)
    deadline = time.monotonic() + 10
    while old.inode in _mapped_inodes():
        assert time.monotonic() < deadline, "the replaced shard's segment is still mapped"
        gc.collect()
        time.sleep(0.05)


def test_a_plane_maps_its_shards_segments_before_its_first_transfer(
        one_shard: InProcessSystem, w: Any) -> None:
    """Mapping a segment populates every page (tens of ms): the connector pays it when it
    starts (attach_shared), not the first request's save; the first write then uses that
    mapping. A plane without shared memory maps nothing."""
    system = one_shard
    plane = DataPlane(system.meta, system.links)
    link = plane.shards["shard-0"]
    assert isinstance(link, SharedLink) and link.mapped is None
    assert plane.attach_shared() == 1
    mapped = link.mapped
    assert mapped is not None and mapped.alive()
    hashes = w.prompt(2, seed=9)
    blocks, tails = w.prefix_payload(plane.layout, 2, 9)
    assert plane.write_prefix(hashes, blocks, tails).ok
    assert link.mapped is mapped
    assert system.links["shard-0"].shard.stats()["counts"].get("claims", 0) > 0
    assert DataPlane(system.meta, system.links, shared_memory=False).attach_shared() == 0


def test_a_writer_the_shard_cannot_see_writes_through_the_link(
        one_shard: InProcessSystem, w: Any) -> None:
    """A shard refuses claims of a process it does not see live (another pid namespace; here
    a dead one): the write goes through ``write_blocks`` instead, whole and readable."""
    plane = DataPlane(one_shard.meta, one_shard.links)
    link = plane.shards["shard-0"]
    assert isinstance(link, SharedLink)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(gone.pid)
    gone.wait()
    link.writer = (gone.pid, start or 1)
    hashes = w.prompt(2, seed=6)
    blocks, tails = w.prefix_payload(plane.layout, 2, 6)
    assert plane.write_prefix(hashes, blocks, tails).ok
    counts = one_shard.links["shard-0"].shard.stats()["counts"]
    assert counts.get("claims", 0) == 0 and counts["writes"] > 0
    match = one_shard.meta.lookup(LookupRequest(hashes, lease_ttl_s=30.0))
    assert not isinstance(plane.read(match, hashes), Recompute)


def test_the_control_socket_serves_only_claims_and_stops_with_its_shard(
        one_shard: InProcessSystem) -> None:
    from workers.control import ControlClient
    from workers.link import ShardUnavailable

    shard = one_shard.links["shard-0"].shard
    info = shard.shared_pool()
    assert info is not None and info.control
    client = ControlClient("shard-0", info.control)
    assert client.call("release_blocks", HandleBatch.of([]), (os.getpid(), 1)) is None
    with pytest.raises(ValueError, match="not served"):
        client.call("read_blocks", HandleBatch.of([]))
    one_shard.crash_shard("shard-0")
    with pytest.raises(ShardUnavailable):
        client.call("release_blocks", HandleBatch.of([]), (os.getpid(), 1))


@pytest.mark.parametrize("shared", [True, False])
def test_read_into_fills_the_callers_buffers_or_says_recompute(
        one_shard: InProcessSystem, w: Any, shared: bool) -> None:
    plane = DataPlane(one_shard.meta, one_shard.links, shared_memory=shared)
    hashes = w.prompt(3, seed=7)
    blocks, tails = w.prefix_payload(plane.layout, 3, 7)
    assert plane.write_prefix(hashes, blocks, tails).ok
    match = one_shard.meta.lookup(LookupRequest(hashes, lease_ttl_s=30.0))
    want = plane.read(match, hashes, release=False)
    assert not isinstance(want, Recompute)
    dests = {col: [np.zeros_like(a) for a in arrays] for col, arrays in want.items()}
    assert plane.read_into(match, dests, hashes, release=False) is None
    for col, arrays in want.items():
        assert all(np.array_equal(a, d) for a, d in zip(arrays, dests[col], strict=True))
    counts = one_shard.links["shard-0"].shard.stats()["counts"]
    assert (counts.get("reads", 0) == 0) == shared  # shared: no read reached the shard
    one_shard.kill_shard("shard-0")
    assert isinstance(plane.read_into(match, dests, hashes), Recompute)


def test_a_reads_arrays_are_never_reused_while_the_caller_holds_one(
        one_shard: InProcessSystem, w: Any) -> None:
    """Reads answer in recycled buffers (a fresh one costs a page fault per 4 KiB); one is
    taken again only once no array cut from it is left. (Mutation-checked: reusing a buffer
    regardless overwrote the first read's arrays with the second's.)"""
    plane = DataPlane(one_shard.meta, one_shard.links)
    got = []
    for seed in (8, 9):
        hashes = w.prompt(2, seed=seed)
        blocks, tails = w.prefix_payload(plane.layout, 2, seed)
        assert plane.write_prefix(hashes, blocks, tails).ok
        match = one_shard.meta.lookup(LookupRequest(hashes, lease_ttl_s=30.0))
        out = plane.read(match, hashes)
        assert not isinstance(out, Recompute)
        got.append((out, {k: bytes(v[0]) for k, v in out.items()}))
    for out, first in got:  # the first read's arrays still hold its bytes
        assert {k: bytes(v[0]) for k, v in out.items()} == first
    del got
    link = plane.shards["shard-0"]
    assert isinstance(link, SharedLink)
    again = link._arena.take(1)  # every array is gone now: a kept buffer is taken again
    assert any(np.shares_memory(again, b) for b in link._arena._bufs)



def test_a_claimed_block_is_not_readable_until_finished() -> None:
    """Even through the shard's own reads (Ray, offload): a block a worker is filling holds
    no object's bytes yet, whatever handle names it."""
    pools = PoolSet({"c": 4096}, 2, "cpu", shared=True)
    pool = pools["c"]
    me = (os.getpid(), process_start(os.getpid()) or 0)
    pool.claim(0, 1, 5, 4096, me)
    assert not pool.readable(np.array([0]), np.array([1]), np.array([5]))[0]
    with pytest.raises(StaleRead):
        pool.read(0, 1, 5)
    pool.finish(0, 1, 5, me)
    assert pool.readable(np.array([0]), np.array([1]), np.array([5]))[0]
    assert pool.read(0, 1, 5).nbytes == 4096
    pools.segment.close()  # type: ignore[union-attr]
