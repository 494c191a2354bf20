"""The metadata service from its settings; ``hkv serve`` around it (flags, signals).

:func:`start_service` is the one way a service starts from a
:class:`~hkv_service.settings.ServiceSettings`: ``hkv serve`` (and so the process ``hkv up``
spawns) runs it in its own process, ``hkv up --address`` inside its service actor
(``workers.launcher._ServiceHost``). Every setting therefore does the same on every path:
bind, auth guard, TLS/mTLS, allowed CNs, metrics, owner expiry, grace, the state's caps::

    ServiceSettings --load()--> ServiceInputs (token, TLS bytes, spec)
        --start_service()--> RunningService: gRPC server + /metrics + expiry thread
        --drain()--> health NOT_SERVING --close(grace)--> stopped

``hkv serve`` exit codes: 0 after a clean shutdown, 2 for bad flags (one sentence on
stderr), 1 when the port cannot be bound. Once bound it prints ``hkv serve: listening on
HOST:PORT`` (flushed), which launchers and tests wait for. SIGTERM/SIGINT: health NOT_SERVING
first, then ``server.stop(grace)``. Started by ``hkv up`` or a demo (``HKV_PARENT_FD``,
:mod:`hkv_service.lifeline`): the same once that process is gone, however it ended.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from grpc_health.v1 import health_pb2
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from hkv_service.core.state_view import CacheState
from hkv_service.lifeline import watch_parent
from hkv_service.settings import ServiceInputs, ServiceSettings, SettingsError

from . import gcpolicy
from .app import ServerConfig, Service, build_service
from .auth import TlsPem
from .metrics import make_registry
from .tokenbook import TokenBook

__all__ = ["RunningService", "run_serve", "server_config", "start_service"]

log = logging.getLogger("hkv.serve")
EXPIRE_EVERY_S = 1.0
REAP_IDLE_S = 0.05  # how often the reaper looks for a lost owner when there is none
REAP_YIELD_S = 0.0005  # between two slices: heartbeats and lookups take the lock here
OWNER_HEALTH_PREFIX = "hkv.v1.Shard/"  # + owner id: a per-shard health status
DRAIN_S = 0.5  # NOT_SERVING is visible this long before new RPCs are refused
BACKSTOP_S = 10.0  # past the grace, a service whose parent died exits hard


def server_config(settings: ServiceSettings, inputs: ServiceInputs) -> ServerConfig:
    tls = None
    if inputs.tls_cert is not None and inputs.tls_key is not None:
        tls = TlsPem(inputs.tls_cert, inputs.tls_key, inputs.tls_ca)
    return ServerConfig(host=settings.host, port=settings.port, auth_token=inputs.token,
                        tls=tls, allowed_cns=settings.tls_allowed_cn)


class SettingsInfo(Collector):
    """``hkv_settings_info{...} 1``: the settings this service runs with, the walk segment
    size as the state resolved it."""

    def __init__(self, settings: ServiceSettings, state: CacheState) -> None:
        self.settings, self.state = settings, state

    def collect(self) -> Iterator[Metric]:
        labels = {f.name: _label(getattr(self.settings, f.name))
                  for f in fields(ServiceSettings)}
        labels["walk_segment_blocks"] = str(self.state.segment_blocks)
        labels["partition"] = str(self.state.partition)
        labels["range_blocks"] = str(self.state.range_blocks)
        yield InfoMetricFamily("hkv_settings", "Settings of this metadata service",
                               value=labels)


class KvEventsCounts(Collector):
    """``hkv_kv_events_total{what=...}``: the KV event publisher's batches, events, re-syncs
    (it fell behind the log), log entries it lost doing so, and replays served."""

    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("hkv_kv_events", "The KV event stream", labels=["what"])
        for what, n in self.publisher.stats.items():
            family.add_metric([what], n)
        yield family


def _label(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    return "" if value is None else str(value)


@dataclass(slots=True)
class RunningService:
    settings: ServiceSettings
    service: Service
    metrics: Any  # the /metrics HTTP server, or None
    stop_expiry: threading.Event
    kv_events: Any = None  # the KV event publisher (server/kvevents.py), or None

    @property
    def address(self) -> str:
        """What the server is bound to, ``HOST:PORT`` (the port as bound: 0 picks one)."""
        return f"{self.settings.host}:{self.service.port}"

    def drain(self) -> None:
        """Health NOT_SERVING; RPCs are still answered until :meth:`close`."""
        self.service.set_serving(False)

    def close(self, grace_s: float | None = None) -> threading.Event:
        """Stop: in-flight RPCs get ``grace_s`` (default: the settings' ``grace_s``)."""
        self.stop_expiry.set()
        if self.kv_events is not None:
            self.kv_events.close()
        done = self.service.stop(self.settings.grace_s if grace_s is None else grace_s)
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
        return done


def start_service(settings: ServiceSettings, inputs: ServiceInputs | None = None,
                  own_process: bool = False) -> RunningService:
    """Bind and start. Raises SettingsError (from ``load``), or RuntimeError/OSError when a
    port cannot be bound. ``own_process``: this process is the service (``hkv serve``, the
    service actor): it also takes the service's GC policy (``gcpolicy``)."""
    inputs = inputs if inputs is not None else settings.load()
    settings = settings.service()
    state = CacheState(inputs.spec, settings.state_config())
    tokens = TokenBook(inputs.spec.hash_block_size) if settings.kv_events_port else None
    service = build_service(server_config(settings, inputs), state, tokens)
    metrics = events = None
    try:
        if tokens is not None:
            events = start_kv_events(settings, state, tokens)
        if settings.metrics_port:
            registry = make_registry(state)
            registry.register(SettingsInfo(settings, state))
            if events is not None:
                registry.register(KvEventsCounts(events))
            metrics, _thread = start_http_server(settings.metrics_port, addr=settings.host,
                                                 registry=registry)
        service.server.start()
    except BaseException:
        service.server.stop(0)
        if metrics is not None:
            metrics.shutdown()
        if events is not None:
            events.close()
        raise
    if not settings.guarded:
        log.warning("binding %s without TLS or auth token (--insecure): anyone who can reach "
                    "it can change cache state", settings.host)
    stop = start_maintenance(state, service)
    if own_process:
        gcpolicy.install(stop)
    return RunningService(settings, service, metrics, stop, events)


def start_kv_events(settings: ServiceSettings, state: CacheState, tokens: TokenBook) -> Any:
    """The KV event publisher the settings ask for, bound and running (imported here: a
    service without one never loads zmq)."""
    from .kvevents import EventForm, KvEventPublisher, KvEventsConfig

    config = KvEventsConfig(settings.kv_events_host, settings.kv_events_port,
                            settings.kv_events_topic, EventForm(settings.kv_events_form))
    events = KvEventPublisher(state, config, tokens, state.partition)
    log.info("KV events: PUB %s, replay %s, topic %r, epoch %d", events.endpoint,
             events.replay_endpoint, events.topic.decode(), events.epoch)
    return events


def start_maintenance(state: CacheState, service: Service) -> threading.Event:
    """The service's own work beside the RPCs: expiring silent owners (and publishing their
    health) and reaping lost ones. Set the returned event to stop both."""
    stop = threading.Event()
    threading.Thread(target=_expire_loop, args=(state, stop, service), daemon=True,
                     name="hkv-expire").start()
    threading.Thread(target=reap_loop, args=(state, stop), daemon=True, name="hkv-reap").start()
    return stop


def _expire_loop(state: CacheState, stop: threading.Event, service: Service) -> None:
    while not stop.wait(EXPIRE_EVERY_S):
        lost = state.expire_owners()
        if lost:
            log.warning("owners silent past the heartbeat timeout, marked lost: %s", lost)
        publish_owner_health(service, state)


def reap_loop(state: CacheState, stop: threading.Event) -> None:
    """Bury lost owners' objects a slice at a time (``CacheState.reap``), the lock released
    between slices: an owner loss never holds the view for the whole owner."""
    while not stop.is_set():
        if state.reap():
            time.sleep(REAP_YIELD_S)
        else:
            stop.wait(REAP_IDLE_S)


def publish_owner_health(service: Service, state: CacheState) -> None:
    """Per owner, the standard health service's per-service status: ``hkv.v1.Shard/<id>``
    SERVING while the owner is alive, NOT_SERVING once it is lost (``grpc_health_probe
    -service hkv.v1.Shard/shard-...``)."""
    for owner, alive in state.owner_liveness().items():
        service.health.set(f"{OWNER_HEALTH_PREFIX}{owner}",
                           health_pb2.HealthCheckResponse.SERVING if alive
                           else health_pb2.HealthCheckResponse.NOT_SERVING)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = ServiceSettings.from_args(args)
        inputs = settings.load()
    except SettingsError as err:
        sys.stderr.write(f"hkv serve: error: {err}\n")
        return 2
    try:
        running = start_service(settings, inputs, own_process=True)
    except (RuntimeError, OSError) as err:
        sys.stderr.write(f"hkv serve: cannot bind {settings.host}:{settings.port}: {err}\n")
        return 1
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %s: health NOT_SERVING, stopping with %.1fs grace", signum,
                 settings.grace_s)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # started by hkv up or a demo (workers.launcher): stop as on SIGTERM once that process is
    # gone, however it ended; hard exit if the drain has not ended well past the grace
    watch_parent(done.set, settings.grace_s + BACKSTOP_S)
    print(f"hkv serve: listening on {running.address}", flush=True)
    while not done.wait(0.5):
        pass
    running.drain()  # probes see NOT_SERVING before the port closes
    drain = min(DRAIN_S, settings.grace_s / 2)
    time.sleep(drain)
    running.close(settings.grace_s - drain).wait(settings.grace_s + 5.0)
    log.info("stopped")
    return 0
