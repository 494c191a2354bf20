"""The connector's counters, reported through vLLM's ``KVConnectorStats`` hook.

Plain ``{name: number}`` so they cross from the worker to vLLM's logger process as is, and two
snapshots add up key by key. Names: ``probes``, ``probe_tokens`` (tokens hkv certified beyond
vLLM's own hit), ``downgrade.<REASON>`` (hkv's reasons for answering less than the hashes
matched), ``source.host`` / ``source.disk`` (tokens served from shard memory or loaded from a
disk tier first), ``load_ok``, ``load_failed``, ``load_failed.<why>``, ``loaded_tokens``,
``loaded_bytes`` (what the loads read and copied into vLLM's pages; over ``read_s``, the load
path's rate),
``saved_blocks``, ``existing_blocks``, ``save_failed``, ``lookup_s``, ``read_s``, ``write_s``
(``save_jobs`` of them: a save's allocate, write and commit after its staging),
``alloc_lookup_s`` (the leased lookups made at allocation: inside vLLM's step, also in
``lookup_s``; a hit whose load takes the probe's match makes none), ``leases_given_back``
(probe leases no load took, released from the probe lane).
Probes (scheduler, off the step): ``probe_batches`` (lane tasks: the probes asked in one step),
``probe_s`` (their hashing and lookups), ``probe_late`` (a request computed because its probe
was pending past ``probe_wait_s``), ``probe_abandoned`` (probes whose lane task never ran),
``probe_waited_s`` (what the steps waited for probes: at most ``probe_step_wait_s`` and a
tenth of the step before, a step),
``probe_deferred`` (probes not answered within their step's wait: vLLM asked again later),
``probe_not_waited`` (not answered in time while recent answers were misses: computed at
once, no wait; ``scheduler.DEFER_MIN_HIT_RATE``).
Off the step (worker): ``stage_s`` / ``staged_bytes`` (the in-step copies out of vLLM's cache),
``save_dropped`` (blocks not staged: the staging budget was full), ``save_abandoned`` (blocks
of a save never run: its lane's thread died under it, or shutdown's drain ran out),
``load_failed.abandoned``; scheduler: ``finished_while_loading`` (a request that ended while
its load was in flight: nothing saved, vLLM frees its blocks once the load is reported).
Recurrent states: ``state_handoffs`` / ``state_handoffs_dropped`` (what vLLM handed off, and
what was not saved: no resume point of hkv's, null block, request gone), ``state_saves``
(states written), ``loaded_states`` (states copied into vLLM's planned block);
``requests_asked`` and ``requests_short_no_state`` (requests whose certified hit was shorter
than asked because a recurrent group kept no state at the longer boundary).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["Counters", "HkvStats"]


class HkvStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]
    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = Counter(self.data)
        out.update(other.data)
        return HkvStats(dict(out))

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not self.data


class Counters:
    """Thread-safe counters one side of the connector adds to; ``take`` empties them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: Counter[str] = Counter()
        self.total: Counter[str] = Counter()  # since start, never taken: for tests and benches

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._data[name] += n  # type: ignore[assignment]
            self.total[name] += n  # type: ignore[assignment]

    def take(self) -> HkvStats | None:
        with self._lock:
            data: dict[str, Any] = dict(self._data)
            self._data.clear()
        return HkvStats(data) if data else None
