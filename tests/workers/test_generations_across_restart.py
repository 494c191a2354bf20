"""Block generations stay monotonic across a re-registration (a service restart, or a shard
declared lost that rejoins): a claim handed out before it can never write into a block the
new registration gave out, nor over a block the shard kept and re-confirmed.

Before: the shard set every non-kept block back to generation 0 (as the new service's fresh
pool twin handed blocks out from 0), so a writer holding a pre-restart claim at generation 4
was accepted as newer, and the block was dead for the new service until its generations
passed 4 (every write in between StaleWrite). A kept block stayed at its old generation, so
a pre-restart claim on it one generation up overwrote the re-confirmed object's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hkv_service.core.api import AllocRequest, Handle, LookupRequest
from hkv_service.core.states import Event
from workers.dataplane import Recompute
from workers.generations import FLOOR_BITS, next_floor
from workers.inprocess import InProcessSystem
from workers.pool import BlockPool
from workers.shm import this_writer


def _claims_block_zero_at(system: InProcessSystem, hashes: list[Any], column: str,
                          releases: int) -> Handle:
    """A claim (allocated, never written) of block 0 of ``column`` after ``releases`` frees of
    that block: its generation is ``releases`` above the block's first."""
    first = None
    for _ in range(releases):
        a = system.meta.allocate(hashes, [AllocRequest(0, column)])[0]
        first = a.handle.generation if first is None else first
        system.meta.transition(a.handle.object_id, Event.EVICT)
    claim = system.meta.allocate(hashes, [AllocRequest(0, column)])[0].handle
    assert first is not None and (claim.block, claim.generation) == (0, first + releases)
    return claim


def _bytes_for(handle: Handle, value: int) -> np.ndarray:
    return np.full(handle.nbytes, value, np.uint8)


def test_a_claim_from_before_a_service_restart_cannot_take_a_block_the_new_service_gives_out(
        inprocess: Callable[..., InProcessSystem], w: Any) -> None:
    system = inprocess(shards=1, blocks_per_group=8)
    plane = system.dataplane()
    stale = _claims_block_zero_at(system, w.prompt(1, seed=1), "c4", releases=4)
    system.restart_service()
    shard = system.links["shard-0"].shard
    # a worker on the node claiming the block to copy into shared memory itself: refused
    assert shard.pools.segment is not None
    claims = shard.claim_blocks([stale], [stale.nbytes], this_writer())
    assert claims is not None and not claims[0].ok, "a pre-restart claim took a block (shm)"
    (late,) = shard.write_blocks([stale], [_bytes_for(stale, 9)])
    assert not late.ok, "a pre-restart claim wrote into a block of the new registration"
    # the new service's first c4 block is block 0: its writer gets it, reads its bytes back
    hashes = w.prompt(2, seed=2)  # one whole LCM block (c128 spans two hash blocks)
    blocks, tails = w.prefix_payload(plane.layout, 2, seed=2)
    rep = plane.write_prefix(hashes, blocks, tails)
    assert rep.ok, rep.failed
    assert rep.handles[(0, "c4")].block == 0
    m = system.meta.lookup(LookupRequest(hashes))
    assert m.usable_tokens == 2 * plane.layout.hash_block
    out = plane.read(m, hashes)
    assert not isinstance(out, Recompute), out
    assert out["c4"][0].tobytes() == blocks[(0, "c4")].tobytes()


def test_a_claim_from_before_a_restart_cannot_overwrite_a_kept_block(
        inprocess: Callable[..., InProcessSystem], w: Any) -> None:
    system = inprocess(shards=1, blocks_per_group=8)
    plane = system.dataplane()
    kept_hashes = w.prompt(2, seed=3)
    blocks, tails = w.prefix_payload(plane.layout, 2, seed=3)
    rep = plane.write_prefix(kept_hashes, blocks, tails)
    assert rep.ok, rep.failed
    kept = rep.handles[(0, "c4")]
    # the old service evicts it (the shard is not told: its tag still vouches for the bytes)
    # and gives its block to a writer that stalls before writing
    system.meta.transition(kept.object_id, Event.EVICT)
    stale = system.meta.allocate(w.prompt(1, seed=4), [AllocRequest(0, "c4")])[0].handle
    assert (stale.block, stale.generation) == (kept.block, kept.generation + 1)
    system.restart_service()  # the shard re-confirms the intact block: a hit again
    m = system.meta.lookup(LookupRequest(kept_hashes))
    assert m.usable_tokens == 2 * plane.layout.hash_block
    shard = system.links["shard-0"].shard
    (late,) = shard.write_blocks([stale], [_bytes_for(stale, 9)])
    assert not late.ok, "a pre-restart claim overwrote a re-confirmed block"
    out = plane.read(m, kept_hashes)
    assert not isinstance(out, Recompute), out
    assert out["c4"][0].tobytes() == blocks[(0, "c4")].tobytes()


def test_generations_only_grow_across_restarts(
        inprocess: Callable[..., InProcessSystem], w: Any) -> None:
    """Every generation handed out after a restart is above every one handed out before it,
    restart after restart, on every pool of the shard (a claim is never older or equal to a
    block's by accident)."""
    system = inprocess(shards=1, blocks_per_group=8)
    shard = system.links["shard-0"].shard
    seen = 0
    for round_ in range(3):
        handle = system.meta.allocate(w.prompt(1, seed=10 + round_),
                                      [AllocRequest(0, "c4")])[0].handle
        assert handle.generation > seen or round_ == 0
        seen = max(seen, handle.generation)
        pools: dict[str, BlockPool] = shard.pools.pools
        seen = max(seen, *(int(p.generation.max()) for p in pools.values()))
        system.restart_service()
        floors = {int(p.generation.min()) for p in pools.values()}
        assert min(floors) > seen, (floors, seen)


def test_a_claim_from_before_a_shard_restart_cannot_take_a_block_of_its_successor(
        inprocess: Callable[..., InProcessSystem], w: Any) -> None:
    """The successor process registers above its predecessor (the clock's epoch), so a claim
    on the predecessor's pool never writes into the successor's."""
    system = inprocess(shards=1, blocks_per_group=8)
    stale = _claims_block_zero_at(system, w.prompt(1, seed=5), "c4", releases=3)
    system.kill_shard("shard-0")
    shard = system.links["shard-0"].shard
    (late,) = shard.write_blocks([stale], [_bytes_for(stale, 9)])
    assert not late.ok, "a claim on the crashed process's pool wrote into its successor's"
    plane = system.dataplane()
    hashes = w.prompt(2, seed=6)
    blocks, tails = w.prefix_payload(plane.layout, 2, seed=6)
    rep = plane.write_prefix(hashes, blocks, tails)
    assert rep.ok, rep.failed


def test_the_floor_is_above_the_last_one_what_the_pools_hold_and_the_clock() -> None:
    unit = 1 << FLOOR_BITS
    now = 1_800_000_000 * 10**9  # 2027: the clock's epoch is the largest
    by_clock = next_floor(0, [], now_ns=now)
    assert by_clock > 0 and by_clock % unit == 0
    assert next_floor(by_clock, [], now_ns=now) == by_clock + unit  # the same instant
    assert next_floor(by_clock, [], now_ns=now - 10**12) == by_clock + unit  # clock went back
    held = by_clock + 5 * unit + 17  # a block far past the clock's epoch
    assert next_floor(by_clock, [3, held], now_ns=now) == by_clock + 6 * unit
