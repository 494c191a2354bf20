"""The reference-model demo: a seeded workload driven through hkv, checked against recompute.

Parts: :mod:`.workload` (requests), :mod:`.backend` (the cache the workers talk to),
:mod:`.faults` (named fault injection), :mod:`.worker` (lookup -> read -> import -> extend ->
check -> write back) and :mod:`.run` (``hkv demo``).

Environment variables:

* ``HKV_DEMO_BACKEND``: ``inprocess`` (default; a :class:`~hkv_service.core.state_view.CacheState`
  with an in-memory block store and a real LMDB disk tier in a temp dir) or ``system`` (the
  embedded service; falls back to in-process with a printed note when it cannot start).
* ``HKV_UNSAFE_DISABLE_LAYER3=1``: TEST ONLY. The backend trusts hash-level hits (the funnel's
  ``matched_tokens``, cut to whole LCM blocks) instead of its ``usable_tokens`` and reads
  whatever bytes those objects hold. Used to prove the silent-error check can fail.
"""

from __future__ import annotations
