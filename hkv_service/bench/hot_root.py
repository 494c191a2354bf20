"""The service bench's ``hot_root`` section: one system prompt under every request, its chains
kept whole in the root's partition (``range_blocks`` 0, the baseline, measured in the same
run) against chains split every ``range_blocks`` blocks across the partitions.

The partitions are ``LocalMetadata`` views in this process behind one ``PartitionedMetadata``
(the port every caller uses), so the figures are the split's own work and its spread, not
RPC costs (the ``partitions`` section measures those). Every prompt is the shared system
prompt (``SYSTEM_BLOCKS``) followed by blocks of its own (``OWN_BLOCKS``), every column of
every block written and committed. Then each prompt is looked up whole (handles packed, no
lease), twice; per configuration:

* ``hottest_objects_share`` / ``hottest_lookup_time_share``: the busiest partition's share
  of the objects held and of the time the partitions spent answering lookups (1/N is an even
  spread, 1.0 all on one);
* ``lookups_per_s``: whole lookups through the port, one thread (a split lookup is one call
  per range per round, here in-process: the split's own cost). A range is memoised as its
  own question from the memo's 32-block minimum on: the 16-block split (``split``) is
  walked every time, so ``whole_no_memo``, whole chains with the lookup memo off, is
  measured too; ``split_long`` splits every :data:`LONG_RANGE_BLOCKS` blocks, where the
  system prompt's ranges are answered by their memos;
* ``rounds_per_lookup``: rounds of the fixed point a lookup took (1: all ranges agreed at once);
* ``usable_tokens_equal``: 1.0 when every lookup's answer equals the whole-chain one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import xxhash

from ..core.api import LookupRequest, StateConfig
from ..core.ids import BlockHash, ShardId
from ..core.layout import Layout
from ..core.partitions import Partition
from ..core.state_view import CacheState
from ..specs import default_spec
from ..testing import pools_for

__all__ = ["run"]

SYSTEM_BLOCKS = 64  # the shared system prompt
OWN_BLOCKS = 16  # each request's own blocks after it
RANGE_BLOCKS = 16  # the split measured first (under the memo's minimum: walked every time)
LONG_RANGE_BLOCKS = 32  # ... and at the memo's minimum (StateConfig.memo_min_blocks)
OWNER = ShardId("bench-hot-root")


def _prompts(n: int) -> list[list[BlockHash]]:
    system = [BlockHash(xxhash.xxh3_128_digest(b"hkv hot root"))]
    for d in range(1, SYSTEM_BLOCKS):
        system.append(BlockHash(xxhash.xxh3_128_digest(system[-1] + b"%d" % d)))
    out = []
    for i in range(n):
        chain = list(system)
        for d in range(OWN_BLOCKS):
            chain.append(BlockHash(xxhash.xxh3_128_digest(chain[-1] + b"own %d %d" % (i, d))))
        out.append(chain)
    return out


class _Timed:
    """A partition whose lookups are timed (the rest passes through)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.lookup_s, self.lookups = inner, 0.0, 0

    def lookup(self, req: LookupRequest) -> Any:
        t = time.perf_counter()
        try:
            return self.inner.lookup(req)
        finally:
            self.lookup_s += time.perf_counter() - t
            self.lookups += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _measure(prompts: Sequence[list[BlockHash]], count: int, range_blocks: int,
             memo: bool = True) -> tuple[dict[str, float], list[int]]:
    from workers.local import LocalMetadata
    from workers.partitioned import PartitionedMetadata

    from .partitions import _Writer

    spec = default_spec()
    layout = Layout(spec)
    base = StateConfig(range_blocks=range_blocks)
    if not memo:
        base = replace(base, memo_capacity=0)
    locals_ = [LocalMetadata(CacheState(spec, replace(base, partition=Partition(i, count))))
               for i in range(count)]
    parts = [_Timed(p) for p in locals_]
    meta = PartitionedMetadata(parts, inline=True)  # each partition's time its own work
    try:
        meta.register_owner(OWNER, pools_for(layout, 1 << 16))
        write = _Writer(layout, len(prompts[0]), OWNER)
        for chain in prompts:
            write(meta, chain)
        for p in parts:
            p.lookup_s, p.lookups = 0.0, 0
        usable: list[int] = []
        t = time.perf_counter()
        for _ in range(2):
            usable = [meta.lookup(LookupRequest(chain)).usable_tokens for chain in prompts]
        elapsed = time.perf_counter() - t
        objects = [p.state.object_count() for p in locals_]
        busy = [p.lookup_s for p in parts]
        calls = sum(p.lookups for p in parts)
        per_lookup_ranges = -(-len(prompts[0]) // range_blocks) if range_blocks else 1
        return {
            "hottest_objects_share": max(objects) / sum(objects),
            "hottest_lookup_time_share": max(busy) / sum(busy),
            "lookups_per_s": 2 * len(prompts) / elapsed,
            "rounds_per_lookup": calls / (2 * len(prompts)) / per_lookup_ranges,
        }, usable
    finally:
        meta.close()


def run(quick: bool = False) -> dict[str, Any]:
    prompts = _prompts(40 if quick else 200)
    counts = (2,) if quick else (2, 4)
    out: dict[str, Any] = {"system_blocks": SYSTEM_BLOCKS, "own_blocks": OWN_BLOCKS,
                           "prompts": len(prompts), "range_blocks": RANGE_BLOCKS,
                           "long_range_blocks": LONG_RANGE_BLOCKS, "by_count": {}, "ratios": {}}
    for n in counts:
        whole, want = _measure(prompts, n, 0)
        walk, _ = _measure(prompts, n, 0, memo=False)
        split, got = _measure(prompts, n, RANGE_BLOCKS)
        split["usable_tokens_equal"] = 1.0 if got == want and all(want) else 0.0
        long, got_long = _measure(prompts, n, LONG_RANGE_BLOCKS)
        long["usable_tokens_equal"] = 1.0 if got_long == want and all(want) else 0.0
        out["by_count"][str(n)] = {"whole": whole, "whole_no_memo": walk, "split": split,
                                   "split_long": long}
        out["ratios"][f"lookups_per_s_{n}_split_long_vs_whole"] = (
            long["lookups_per_s"] / whole["lookups_per_s"])
        out["ratios"][f"hottest_lookup_time_share_{n}_split_long_vs_whole"] = (
            long["hottest_lookup_time_share"] / whole["hottest_lookup_time_share"])
        out["ratios"][f"hottest_lookup_time_share_{n}_split_vs_whole"] = (
            split["hottest_lookup_time_share"] / whole["hottest_lookup_time_share"])
        out["ratios"][f"hottest_objects_share_{n}_split_vs_whole"] = (
            split["hottest_objects_share"] / whole["hottest_objects_share"])
        out["ratios"][f"lookups_per_s_{n}_split_vs_whole"] = (
            split["lookups_per_s"] / whole["lookups_per_s"])
        # (16-block ranges are under the memo's minimum: against whole chains walked each time)
        out["ratios"][f"lookups_per_s_{n}_split_vs_whole_no_memo"] = (
            split["lookups_per_s"] / walk["lookups_per_s"])
    return out
