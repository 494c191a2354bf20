"""The planted bugs that prove the demo's ``--check`` can fail: each patches the real
functions of the code it breaks, in this process, for one test (production has no switch).

* ``layer3_off``: the funnel reports every whole LCM block whose hash is present as usable
  ("the hash matched"), and each column serves whatever copy it has, in whatever state.
* ``read_check_skipped``: a shard's ``read_blocks`` hands out whatever a block holds, its
  generation and occupant re-check skipped.
* ``state_boundary_unchecked``: the writer files a recurrent state under a boundary without
  comparing the position it is as of (``workers.checkpoints``' boundary check skipped).

Both reach only code running in this process: the tests run the demo in-process (what
``run_workload`` does unless asked for the system).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from hkv_service.core import contracts, funnel, lookups, packing
from hkv_service.core.api import LookupRequest
from hkv_service.core.funnel import FunnelResult
from hkv_service.core.layout import Layout
from hkv_service.core.prefix_index import PrefixIndex
from hkv_service.core.records import ObjRecord, PrefixEntry
from hkv_service.demo import backend
from workers import checkpoints
from workers.pool import BlockPool


def _any_copy(entry: PrefixEntry, column: int) -> ObjRecord | None:
    return entry.mem[column] or (entry.disk[column] if entry.disk else None)


def _hash_level_hit(index: PrefixIndex, layout: Layout, req: LookupRequest, limit: int,
                    segment_blocks: int = 0, align_of: Callable[[ObjRecord], int] | None = None
                    ) -> FunnelResult:
    """The funnel with layer 3 off: every whole LCM block of present hashes (an ABI
    mismatch still refuses the hit, as layer 2 runs first)."""
    abi = funnel._abi_downgrades(req, layout)
    if abi:
        return FunnelResult(0, 0, (), abi)
    entries = []
    for h in itertools.islice(req.block_hashes, limit // layout.hash_block):
        e = index.get(h)
        if e is None:
            break
        entries.append(e)
    usable = len(entries) * layout.hash_block // layout.lcm * layout.lcm
    return FunnelResult(usable, len(entries) * layout.hash_block,
                        entries[: usable // layout.hash_block], (), entries)


@pytest.fixture
def layer3_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    served = contracts.served

    def any_served(entry: PrefixEntry, column: int, layout: Layout, pairs: Any = None
                   ) -> contracts.Served:
        rec = _any_copy(entry, column)
        if rec is not None:
            return rec, contracts.READY if rec.block >= 0 else contracts.LOAD
        return served(entry, column, layout, pairs)

    def any_cover(entry: PrefixEntry, column: int, *args: Any, **kwargs: Any
                  ) -> ObjRecord | None:
        return _any_copy(entry, column)

    for module in (contracts, funnel):  # (the funnel imported them by name)
        monkeypatch.setattr(module, "served", any_served)
        monkeypatch.setattr(module, "swa_cover", any_cover)
    monkeypatch.setattr(contracts, "_memory_only", lambda *_args: False)  # summarise by rule
    monkeypatch.setattr(lookups, "run_funnel", _hash_level_hit)
    # a column with a gap the funnel now accepts: packed record by record, the gap left out
    monkeypatch.setattr(packing, "DISKY_PATCHED", -1)
    yield


@pytest.fixture
def read_check_skipped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def every_block(self: BlockPool, blocks: np.ndarray, generations: np.ndarray,
                    object_ids: np.ndarray) -> np.ndarray:
        return np.ones(len(blocks), dtype=bool)

    monkeypatch.setattr(BlockPool, "readable", every_block)
    yield


@pytest.fixture
def state_boundary_unchecked(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real = checkpoints.state_payload

    def any_position(layout: Layout, column: str, depth: int,
                     ckpt: checkpoints.StateCheckpoint) -> np.ndarray:
        claimed = checkpoints.StateCheckpoint(ckpt.parts, (depth + 1) * layout.hash_block)
        return real(layout, column, depth, claimed)

    monkeypatch.setattr(backend, "state_payload", any_position)  # (imported by name)
    yield
