"""The connector's settings: ``kv_connector_extra_config`` read and checked once.

Two ways to reach hkv, exactly one of them:

* ``endpoint`` (``host:port`` of ``hkv up`` / ``hkv serve``), with ``auth_token_file`` and
  ``tls_*`` as the service needs, and ``ray_address`` / ``ray_namespace`` of the Ray cluster
  whose shard actors hold the bytes (``shards`` names them; default: every ``shard-*`` actor
  in the namespace);
* ``system``: the name an in-process hkv was published under
  (:func:`hkv_service.connectors.systems.publish`): tests and ``hkv bench vllm``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hkv_service.core.sightings import MAX_NEEDED

from .errors import BadConnectorConfig

__all__ = ["ConnectorConfig"]


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    model_id: str | None = None  # default: vLLM's served model name
    endpoint: str | None = None
    auth_token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    ray_address: str = "auto"
    ray_namespace: str = "hkv"
    shards: tuple[str, ...] = ()
    system: str | None = None
    lease_ttl_s: float = 30.0  # a lease pins the loaded objects from alloc to the read
    # a request's first probe runs off the step; pending longer than this, it computes
    probe_wait_s: float = 1.0
    # while other requests run, a scheduler step waits for its new requests' probes at most
    # a tenth of the step before it and at most this long, in all, so a request is usually
    # answered in the step that first sees it (0: never wait; scheduler.STEP_SHARE)
    probe_step_wait_s: float = 0.05
    timeout_s: float = 10.0  # per call to the service or a shard
    spec_out: str | None = None  # write the spec this engine needs here (YAML)
    staging_mib: float = 1024.0  # saves staged off vLLM's cache, not yet landed; past: dropped
    drain_s: float = 10.0  # at shutdown, how long saves in flight get to land
    # a block is saved once offered this many times, by any engine (the service counts:
    # core/sightings.py); 2: a prompt no second request brings is never saved (SGLang's
    # write_through_selective); 1: every block computed is saved
    save_min_sightings: int = 1
    # the connector's lanes (probe, save, load) share the GIL with vLLM's engine loop, which
    # runs steps back to back while a request waits for its load: every time a lane's copy
    # lets go of the GIL it waited up to Python's switch interval (5 ms) to get it back, so
    # a 5-item load took 10-26 ms. The process's interval is lowered to this (never raised;
    # 0: left as it is). lane.shorten_gil_switch
    gil_switch_interval_s: float = 0.0005

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        raw = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise BadConnectorConfig(key, f"unknown key; the keys are {sorted(known)}")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            values[key] = _coerce(key, value, getattr(cls(), key))
        cfg = cls(**values)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if (self.endpoint is None) == (self.system is None):
            raise BadConnectorConfig("endpoint", "give exactly one of 'endpoint' (a running "
                                     "hkv service) and 'system' (an in-process hkv)")
        if self.lease_ttl_s <= 0 or self.timeout_s <= 0 or self.probe_wait_s <= 0:
            raise BadConnectorConfig("lease_ttl_s", "lease_ttl_s, timeout_s and probe_wait_s "
                                     "must be > 0")
        if not 0 <= self.probe_step_wait_s <= self.probe_wait_s:
            raise BadConnectorConfig("probe_step_wait_s", "must be >= 0 and at most "
                                     "probe_wait_s (it is waited inside vLLM's step)")
        if not 0 <= self.gil_switch_interval_s <= 0.1:
            raise BadConnectorConfig("gil_switch_interval_s", "must be >= 0 (0: leave "
                                     "Python's switch interval as it is) and at most 0.1")
        if self.staging_mib <= 0 or self.drain_s < 0:
            raise BadConnectorConfig("staging_mib", "staging_mib must be > 0, drain_s >= 0")
        if not 1 <= self.save_min_sightings <= MAX_NEEDED:
            raise BadConnectorConfig("save_min_sightings", f"must be 1..{MAX_NEEDED} (1: save "
                                     f"every block; 2: blocks a second request brings)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise BadConnectorConfig("tls_cert", "tls_cert and tls_key go together (mTLS)")


def _coerce(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, tuple):
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise BadConnectorConfig(key, f"must be a list of names, got {value!r}")
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        raise BadConnectorConfig(key, f"must be a whole number, got {value!r}")
    if isinstance(default, float):
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise BadConnectorConfig(key, f"must be a number, got {value!r}")
    if not isinstance(value, str) or not value:
        raise BadConnectorConfig(key, f"must be a non-empty string, got {value!r}")
    return value
