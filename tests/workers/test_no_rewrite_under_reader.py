"""The bytes of an object that a reader, a lease, a re-confirm or a tag can still name never
change (issue 35, item 1). A rewrite goes to a fresh object (new id, new block claim); the old
one is retired before the first byte is written, and a reader's lease refuses that.

Both sequences were found by an adversarial review on the reference spec with one shard:
the data plane used to copy an indexer's new keys into the block of the existing (leased, or
tagged) indexer object and only then report the commit. A read of the leased match, or a
lookup after a restart in that window, then paired the old KV with the new keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

from hkv_service.core.api import LookupRequest
from hkv_service.core.states import Event, State
from workers.dataplane import DataPlane, Recompute
from workers.inprocess import InProcessSystem
from workers.pool import BlockPool, StaleWrite
from workers.tags import BlockTag

Payload = dict[tuple[int, str], np.ndarray]


def _four_blocks(system: InProcessSystem, w: Any) -> tuple[DataPlane, list[bytes], Payload]:
    """4 hash blocks written (the c4 KV at depth 3 at v1, its indexer synced to v1); that KV
    offloaded to disk, then its memory copy marked corrupt: a lookup gives 256 tokens with a
    load (disk KV v1 + memory indexer v1)."""
    plane = system.dataplane()
    hashes = w.prompt(4, seed=3)
    blocks, tails = w.prefix_payload(plane.layout, 4, seed=3)
    rep = plane.write_prefix(hashes, blocks, tails)
    assert rep.ok, rep.failed
    kv = rep.handles[(3, "c4")]
    assert plane.offload([kv])[0].ok
    system.meta.transition(kv.object_id, Event.MARK_CORRUPT)
    m = system.meta.lookup(LookupRequest(hashes))
    assert m.usable_tokens == 256 and m.needs_load
    return plane, hashes, {**blocks, **{k: v[0] for k, v in tails.items()}}


def _new_bytes(old: Payload) -> Payload:
    return {(3, "c4"): old[(3, "c4")][::-1].copy(), (3, "idx"): np.full_like(old[(3, "idx")], 7)}


def _assert_one_write(out: Mapping[str, list[np.ndarray]], versions: list[Payload]) -> None:
    """The KV and indexer at depth 3 are the bytes of one and the same write."""
    got = (out["c4"][-1].tobytes(), out["idx"][-1].tobytes())
    pairs = [(v[(3, "c4")].tobytes(), v[(3, "idx")].tobytes()) for v in versions]
    assert got in pairs, "KV and indexer bytes of different writes served together"


def test_a_leased_indexer_keeps_its_bytes_while_a_writer_brings_new_ones(
        inprocess: Callable[..., InProcessSystem], w: Any) -> None:
    system = inprocess(shards=1)
    plane, hashes, old = _four_blocks(system, w)
    leased = system.meta.lookup(LookupRequest(hashes, lease_ttl_s=30.0))
    new = _new_bytes(old)
    writer = system.dataplane()
    # the reader reads in the window between the writer's byte copy and its commit, and after
    hook = _Before(writer.meta, "transition_many",
                   lambda: plane.read(leased, hashes, release=False))
    writer.meta = hook  # type: ignore[assignment]
    rep = writer.write_prefix(hashes, new)
    assert (3, "idx") in rep.failed  # not rewritten under the reader: retried later
    (out,) = hook.fired
    assert not isinstance(out, Recompute), out
    assert out["idx"][-1].tobytes() == old[(3, "idx")].tobytes()
    assert out["c4"][-1].tobytes() == old[(3, "c4")].tobytes()
    now = system.meta.lookup(LookupRequest(hashes, lease_ttl_s=30.0))
    got = plane.read(now, hashes, release=False)  # a second reader meanwhile: one write's
    assert not isinstance(got, Recompute), got
    _assert_one_write(got, [old])
    system.meta.release_lease(now.lease_id)
    system.meta.release_lease(leased.lease_id)
    # the lease is gone: the next writer replaces the indexer (a fresh object) and syncs it
    rep = plane.write_prefix(hashes, new)
    assert rep.ok, rep.failed
    again = system.meta.lookup(LookupRequest(hashes))
    assert again.usable_tokens == 256
    got = plane.read(again, hashes)
    assert not isinstance(got, Recompute), got
    _assert_one_write(got, [old, new])


def test_a_reader_without_a_lease_never_sees_the_new_keys_beside_the_old_kv(
        inprocess: Callable[..., InProcessSystem], w: Any) -> None:
    system = inprocess(shards=1)
    plane, hashes, old = _four_blocks(system, w)
    m = system.meta.lookup(LookupRequest(hashes))
    new = _new_bytes(old)
    plane.write_prefix(hashes, new)
    out = plane.read(m, hashes)  # stale handles recompute; bytes, if any, are one write's
    if not isinstance(out, Recompute):
        _assert_one_write(out, [old])


class _Before:
    """The metadata port, but ``action`` runs right before the first call of ``method``
    (a read, or a service restart, between a write's byte copy and its commit)."""

    def __init__(self, inner: Any, method: str, action: Callable[[], Any]) -> None:
        self.inner, self.method, self.action = inner, method, action
        self.fired: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.method or self.fired:
            return attr

        def action_first(*args: Any, **kwargs: Any) -> Any:
            self.fired.append(self.action())
            return attr(*args, **kwargs)
        return action_first


def test_a_restart_between_the_copy_and_the_commit_vouches_for_no_new_bytes(
        inprocess: Callable[..., InProcessSystem], w: Any) -> None:
    system = inprocess(shards=1)
    plane, hashes, old = _four_blocks(system, w)
    new = _new_bytes(old)
    writer = system.dataplane()
    hook = _Before(writer.meta, "transition_many", system.restart_service)
    writer.meta = hook  # type: ignore[assignment]
    writer.write_prefix(hashes, new)
    assert hook.fired
    m = system.meta.lookup(LookupRequest(hashes))
    if m.usable_tokens < 256:
        return  # the indexer was not vouched for: a shorter hit is safe
    out = plane.read(m, hashes)
    assert not isinstance(out, Recompute), out
    _assert_one_write(out, [old])  # only the old write's commit landed


@pytest.mark.parametrize("column", ["swa", "c4.tail", "idx", "c4"])
def test_a_shard_refuses_new_bytes_for_an_object_it_already_holds(
        inprocess: Callable[..., InProcessSystem], w: Any, column: str) -> None:
    """Every kind, at the edge where bytes enter: a write naming an object whose bytes are
    in the block already changes nothing unless it brings the very same bytes (a retry)."""
    system = inprocess(shards=1)
    plane = system.dataplane()
    hashes = w.prompt(2, seed=5)
    blocks, tails = w.prefix_payload(plane.layout, 2, seed=5)
    rep = plane.write_prefix(hashes, blocks, tails)
    assert rep.ok, rep.failed
    h = rep.handles[(1, column)]
    old = tails[(1, column)][0] if column.endswith(".tail") else blocks[(1, column)]
    link = system.links[h.shard]
    tag = [BlockTag(hashes[1], hashes[0], 1)]  # (sizes a tail)
    again = link.submit("write_blocks", [h], [old], tag, report=False).result(10)
    assert again[0].ok  # the same bytes: an idempotent retry
    other = (old ^ 0xFF).astype(np.uint8)
    refused = link.submit("write_blocks", [h], [other], tag, report=False).result(10)
    assert not refused[0].ok
    m = system.meta.lookup(LookupRequest(hashes))
    out = plane.read(m, hashes)
    assert not isinstance(out, Recompute), out
    assert out[column][-1].tobytes() == old.tobytes()
    state = system.parts[0].state
    assert state.objects[h.object_id].state is not State.ALLOCATED


def test_the_pool_takes_one_set_of_bytes_per_object() -> None:
    import torch

    pool = BlockPool("g", 64, 4, torch.device("cpu"))
    pool.write(1, 0, np.arange(64, dtype=np.uint8), object_id=9)
    pool.write(1, 0, np.arange(64, dtype=np.uint8), object_id=9)  # same bytes: fine
    with pytest.raises(StaleWrite):
        pool.write(1, 0, np.zeros(64, np.uint8), object_id=9)
    assert bytes(pool.read(1, 0)) == bytes(range(64))
    pool.write(1, 1, np.zeros(64, np.uint8), object_id=10)  # a new generation: a new object
