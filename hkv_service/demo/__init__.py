"""The reference-model demo: a seeded workload driven through hkv, checked against recompute.

Parts: :mod:`.workload` (requests), :mod:`.backend` (the cache the workers talk to),
:mod:`.faults` (named fault injection), :mod:`.worker` (lookup -> read -> import -> extend ->
check -> write back) and :mod:`.run` (``hkv demo``).

Wirings (:mod:`.wiring`, chosen by ``--backend``, ``settings.DemoSettings``): ``system``
(``hkv demo``'s default: what ``hkv up`` starts, through gRPC and Ray; falls back to
in-process with a printed note when it cannot start) or ``inprocess`` (``run_workload``'s
default: the same real shards, disk tiers and data plane in this process). The planted bugs
that prove the silent-error check can fail live in the tests, not here: fixtures that patch
the real functions in process (layer 3 of the funnel off, the shards' read re-check skipped;
``tests/demo/conftest.py``).
"""

from __future__ import annotations
