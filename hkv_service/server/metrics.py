"""Prometheus export: a Collector that reads ``CacheState.stats()`` at scrape time.

Nothing is counted twice: the core's counters are the source, read under its lock once per
scrape, on the metrics HTTP thread. The registry is our own (not the process-global one).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hkv_service.core.state_view import CacheState
from hkv_service.core.states import State

__all__ = ["StateCollector", "make_registry", "start_metrics"]

_GAUGES = {
    "in_transit_objects": "Objects in transit between tiers (admission-capped)",
    "in_transit_bytes": "Bytes in transit between tiers (admission-capped)",
    "leases": "Live read leases",
    "objects": "Objects in the state view",
    "entries": "Prefix entries in the state view",
    "captures": "Live graph captures",
    "topology_epoch": "Topology epoch (bumps when a captured block had to change)",
    "owners_alive": "Registered owners currently alive",
    "owners_lost": "Owners registered once and lost since (silent, dead, or replaced)",
    "in_transit_peak_objects": "Most objects in transit at once since the service started",
}


def _section(stats: Mapping[str, object], name: str) -> Mapping[str, Any]:
    value = stats.get(name, {})
    return value if isinstance(value, Mapping) else {}


class StateCollector(Collector):
    def __init__(self, state: CacheState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        stats = self.state.stats()
        tr = CounterMetricFamily("hkv_transitions", "Transitions applied, by kind and the "
                                 "state entered", labels=["kind", "state"])
        for key, n in _section(stats, "transitions").items():
            kind, _, st = key.partition(":")
            tr.add_metric([kind, st], n)
        yield tr
        yield self._counter(stats, "downgrades", "reason", "Lookup downgrades, by reason")
        yield self._counter(stats, "lookups", "result", "Lookups, by hit / partial / miss")
        yield self._counter(stats, "evictions", "kind", "Evictions, by kind")
        yield self._counter(stats, "events", "event", "Notable events (stale reads, lost owners)")
        gauges = _section(stats, "gauges")
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"hkv_{name}", doc, value=gauges.get(name, 0))
        # what hkv stats shows beside the gauges: refusals (monotone) and who holds tickets
        yield CounterMetricFamily("hkv_admission_refused", "Transfers refused by the "
                                  "in-transit admission cap",
                                  value=gauges.get("admission_refused", 0))
        held = GaugeMetricFamily("hkv_in_transit_by_state", "In-transit objects holding an "
                                 "admission ticket, by state", labels=["state"])
        for state in State:
            n = gauges.get(f"in_transit_{state.value.lower()}")
            if n is not None:
                held.add_metric([state.value], n)
        yield held

    @staticmethod
    def _counter(stats: Mapping[str, object], section: str, label: str, doc: str) -> Metric:
        fam = CounterMetricFamily(f"hkv_{section}", doc, labels=[label])
        for key, n in _section(stats, section).items():
            fam.add_metric([key], n)
        return fam


def make_registry(state: CacheState) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(state))
    return registry


def start_metrics(state: CacheState, host: str, port: int) -> Any:
    """Serve /metrics on ``host:port``; returns the HTTP server (call ``shutdown()``)."""
    server, _thread = start_http_server(port, addr=host, registry=make_registry(state))
    return server
