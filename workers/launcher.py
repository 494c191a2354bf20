"""``hkv up``: the metadata service, one cache shard per Ray node, each node's disk tier.

:func:`start_system` brings the parts up and returns a :class:`System`; ``System.stop()``
takes everything down again (shards killed, service stopped by pid, Ray shut down if we
started it): nothing is left running. The CLI around them (flags, --config, signals) is
:mod:`hkv_service.up`::

    ray (local instance, or --address)  ->  metadata service (subprocess `hkv serve`, or a
    detached named Ray actor with --address, on this node)  ->  shards (node affinity, one per
    alive node)  ->  the endpoint

One :class:`~hkv_service.settings.SystemSettings` (``SystemConfig``) says everything: the
service gets its service part whole (``serve_argv`` for the process, the object itself for the
actor, which starts it with the same ``start_service`` as ``hkv serve``), the shards and
``System.metadata()`` get the token and TLS its ``credentials`` derive (they trust the
service's own certificate). What the service is bound to is what is printed; clients dial
the node's address when it binds every address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hkv_service.lifeline import end_processes, let_go, proc_stat, reap_when_gone, spawn_tied
from hkv_service.settings import (
    ServiceInputs,
    ServiceSettings,
    SystemSettings,
    TlsConfig,
    is_loopback,
)

from .budget import RestartBudget
from .dataplane import DataPlane
from .local import connect
from .nodekey import assign_keys, tier_keys
from .raylink import NAMESPACE, SHARD_PREFIX, ray_links
from .shard import ShardActor, ShardConfig

__all__ = [
    "System", "SystemConfig", "clear_stale_ray", "init_local_ray", "ray_address_file",
    "serve_argv", "start_system", "worker_pythonpath",
]

log = logging.getLogger(__name__)

_ray: Any = ray  # some ray entry points are untyped
_HEAD_RESOURCE = "node:__internal_head__"  # ray's marker resource of the head node
RECONCILE_EVERY_TICKS = 10  # hkv up looks for newly joined nodes every 5 s
_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_WILDCARDS = ("0.0.0.0", "::", "[::]", "")
SERVICE_ACTOR = "hkv-metadata"
Emit = Callable[[str], None]


SystemConfig = SystemSettings  # hkv up's settings: the service's, Ray's, the shards'


@dataclass(slots=True)
class System:
    """What ``start_system`` brought up. ``endpoint`` is what clients dial: one HOST:PORT, or
    with ``--service-replicas N`` the N partitions' in partition order, comma-separated
    (``workers.local.connect`` turns it into one port)."""

    config: SystemConfig
    endpoint: str
    shards: dict[str, Any] = field(default_factory=dict)
    services: list[subprocess.Popen[str]] = field(default_factory=list)  # one per partition
    service_actors: list[Any] = field(default_factory=list)  # --address: one per partition
    ray_started: bool = False
    token: str | None = None
    tls: TlsConfig | None = None  # what this side's clients use to reach the service
    replaced: dict[str, int] = field(default_factory=dict)  # shard id -> times replaced
    service_restarts: int = 0  # restarts made so far (the budget below bounds their rate)
    inputs: ServiceInputs | None = None  # what the service actors are started with again
    clock: Callable[[], float] = time.monotonic  # what the restart budgets are spent on
    service_budget: RestartBudget = field(init=False)  # --service-restarts/--restart-window-s
    shard_budgets: dict[str, RestartBudget] = field(default_factory=dict)  # shard id -> its
    held: set[str] = field(default_factory=set)  # dead shards left unreplaced: a crash loop
    node_keys: dict[str, str] = field(default_factory=dict)  # node id -> its disk tiers' key

    def __post_init__(self) -> None:
        self.service_budget = RestartBudget(self.config.service_restarts,
                                            self.config.restart_window_s)

    def shard_budget(self, sid: str) -> RestartBudget:
        """The replacement budget of shard ``sid`` (--shard-replacements/--restart-window-s)."""
        if sid not in self.shard_budgets:
            self.shard_budgets[sid] = RestartBudget(self.config.shard_replacements,
                                                    self.config.restart_window_s)
        return self.shard_budgets[sid]

    @property
    def service(self) -> subprocess.Popen[str] | None:
        """The first partition's process (the only one without --service-replicas)."""
        return self.services[0] if self.services else None

    @property
    def service_actor(self) -> Any:
        return self.service_actors[0] if self.service_actors else None

    @property
    def endpoints(self) -> list[str]:
        return self.endpoint.split(",") if self.endpoint else []

    def metadata(self) -> Any:
        return connect(self.endpoint, self.token, 5.0, self.tls)

    def dataplane(self, timeout_s: float = 10.0) -> DataPlane:
        return DataPlane(self.metadata(), ray_links(self.shards), timeout_s)

    def restart_service_actor(self, index: int, emit: Emit | None = None) -> None:
        """Start partition ``index``'s service actor (--address) again, on the port it had:
        it died (its node, its process); it comes back empty and the shards rejoin it."""
        assert self.inputs is not None
        say = emit or (lambda _msg: None)
        endpoints = self.endpoints
        with contextlib.suppress(Exception):
            ray.kill(self.service_actors[index], no_restart=True)
        replica = replace(replica_settings(self.config, index),
                          port=int(endpoints[index].rsplit(":", 1)[1]))
        actor, _bound, endpoints[index] = _service_actor(self.config, replica, self.inputs,
                                                          index)
        self.service_actors[index] = actor
        self.endpoint = ",".join(endpoints)
        self.service_restarts += 1
        say(f"metadata service actor of partition {replica.partition} restarted on "
            f"{endpoints[index]}")

    def restart_service(self, emit: Emit | None = None, partition: int | None = None) -> None:
        """Start the metadata service process (of ``partition``; default every partition)
        again on the same port, after a crash (or crash it first: SIGKILL, nothing drained).
        It comes back empty; every shard finds out from its next heartbeat (``UnknownOwner``,
        or ``PartitionsLost`` naming that partition) and rejoins it: registers again,
        re-confirms what it holds of that partition's chains."""
        if not self.services:
            raise RuntimeError("only a metadata service process started here (hkv up without "
                               "--address) can be restarted by the launcher")
        say = emit or (lambda _msg: None)
        endpoints = self.endpoints
        for i in range(len(self.services)) if partition is None else [partition]:
            old = self.services[i]
            if old.poll() is None:
                old.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                old.wait(10.0)
            let_go(old)
            replica = replace(replica_settings(self.config, i),
                              port=int(endpoints[i].rsplit(":", 1)[1]))
            self.services[i] = _spawn_service(replica)
            endpoints[i] = _await_listening(self.services[i], self.config.start_timeout_s)
            self.service_restarts += 1
            which = "" if len(self.services) == 1 else f" partition {replica.partition}"
            say(f"metadata service{which} (pid {old.pid}) restarted as pid "
                f"{self.services[i].pid} on {endpoints[i]}")
        self.endpoint = ",".join(endpoints)

    def stop(self, emit: Emit | None = None, hurry: threading.Event | None = None) -> None:
        """Drain and stop everything, each wait bounded; idempotent. Health NOT_SERVING first
        (``hkv serve`` drains on SIGTERM; the actor is told), then shards (``shutdown`` then
        ``ray.kill``), then the service (SIGKILL past its grace), then Ray if we started it,
        with every process of it. ``hurry`` set (a second signal) cuts the waits short."""
        say = emit or (lambda _msg: None)
        for proc in self.services:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                say(f"metadata service (pid {proc.pid}) draining: health NOT_SERVING")
        if self.service_actors:
            with contextlib.suppress(Exception):
                _bounded_wait([a.drain.remote() for a in self.service_actors], 5.0, hurry)
                say("metadata service draining: health NOT_SERVING")
        shards = list(self.shards.items())
        with contextlib.suppress(Exception):
            _bounded_wait([actor.shutdown.remote() for _sid, actor in shards], 5.0, hurry)
        for sid, actor in shards:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            say(f"shard {sid} stopped")
        self.shards.clear()
        for proc in self.services:
            _stop_process(proc, _serve_grace_s(self.config) + 5.0, hurry)
            say(f"metadata service (pid {proc.pid}) stopped")
        self.services = []
        if self.service_actors:
            grace = _serve_grace_s(self.config)
            with contextlib.suppress(Exception):
                _bounded_wait([a.close.remote(grace) for a in self.service_actors],
                              grace + 5.0, hurry)
            for actor in self.service_actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            self.service_actors = []
            say("metadata service stopped")
        if self.ray_started and ray.is_initialized():
            ours = _ray_processes()
            ray.shutdown()
            end_processes(ours, 1.0 if hurry is not None and hurry.is_set() else 5.0)
            self.ray_started = False
            say("ray stopped")


def start_system(config: SystemConfig, emit: Emit | None = None,
                 after_ray_init: Callable[[], None] | None = None,
                 inputs: ServiceInputs | None = None) -> System:
    """``after_ray_init`` runs as soon as Ray is up (``hkv up`` puts its signal handlers
    back there: ``ray.init`` replaces them). ``inputs``: ``config.load()``'s result when the
    caller read it already (hkv up does, before Ray starts); SettingsError from either."""
    say = emit or (lambda _msg: None)
    inputs = inputs if inputs is not None else config.load()
    creds = config.credentials(inputs)
    started = _init_ray(config)
    if after_ray_init is not None:
        after_ray_init()
    say(f"ray: {'started a local instance' if started else 'joined'} "
        f"({len(_alive_nodes())} node(s))")
    system = System(config, "", ray_started=started, token=creds.token, tls=creds.tls,
                    inputs=inputs)
    try:
        bound, dial = [], []
        for i in range(config.service_replicas):
            replica = replica_settings(config, i)
            if config.address is None:
                system.services.append(_spawn_service(replica))
                dial.append(_await_listening(system.services[-1], config.start_timeout_s))
                bound.append(f"{config.host}:{dial[-1].rsplit(':', 1)[1]}")
            else:
                actor, b, d = _service_actor(config, replica, inputs, i)
                system.service_actors.append(actor)
                bound.append(b)
                dial.append(d)
        if config.address is not None:
            _check_reachable(config)
        system.endpoint = ",".join(dial)
        for i, (b, d) in enumerate(zip(bound, dial, strict=True)):
            via = "" if b == d else f" (clients dial {d})"
            pid = f" (pid {system.services[i].pid})" if system.services else ""
            which = "" if config.service_replicas == 1 else \
                f" partition {i}/{config.service_replicas}"
            say(f"metadata service{which}{pid} listening on {b}{via}")
        system.shards = place_shards(config, system.endpoint, creds.token, tls=creds.tls,
                                     keys=system.node_keys)
        say(f"{len(system.shards)} shard(s) up: {', '.join(sorted(system.shards))}")
    except BaseException:
        system.stop()
        raise
    return system


def replica_settings(config: SystemConfig, index: int) -> ServiceSettings:
    """The service settings of partition ``index``: the service's own, on the index-th port
    from --port (and --metrics-port; 0 stays 0: each picks a free one)."""
    n = config.service_replicas
    service = config.service()
    return replace(service, partition=f"{index}/{n}",
                   port=service.port + index if service.port else 0,
                   metrics_port=service.metrics_port + index if service.metrics_port else 0)


# -- ray ------------------------------------------------------------------------------------

def _init_ray(config: SystemConfig) -> bool:
    if ray.is_initialized():
        return False
    if config.address is not None:
        ray.init(address=config.address, namespace=NAMESPACE, include_dashboard=False)
        return False
    # Not bound to loopback: Ray 2.60 turns a 127.0.0.1 node address into the machine's own
    # (services.resolve_ip_for_localhost), so its processes listen there; no dashboard.
    kwargs: dict[str, Any] = {"address": "local", "include_dashboard": False,
                              "namespace": NAMESPACE, "num_cpus": config.num_cpus,
                              "runtime_env": {"env_vars": {"PYTHONPATH": worker_pythonpath()}}}
    init_local_ray(**kwargs)
    return True


def init_local_ray(attempts: int = 3, **kwargs: Any) -> None:
    """``ray.init`` for a local instance that survives two known start-up failures: a stale
    session file left by a killed instance (ray would try to join a dead cluster), and a raylet
    slower than ray's fixed 30 s registration wait on an overloaded 2-core machine."""
    clear_stale_ray()
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            _watch_ray()
            return
        except ConnectionError:
            ray_address_file().unlink(missing_ok=True)
        except Exception as err:  # ray raises a bare Exception for the start-up timeout
            if "timed out during startup" not in str(err) or attempt == attempts:
                raise
            log.warning("ray start-up timed out (attempt %d/%d); retrying", attempt, attempts)
        ray.shutdown()
    ray.init(**kwargs)
    _watch_ray()


_ray_watch: list[subprocess.Popen[Any]] = []  # the watcher of the local Ray started last


def _watch_ray() -> None:
    """Once this process is gone, however it ended (a SIGKILLed ``hkv up`` or demo), the local
    Ray it started ends too. Ray ends most of it with us (``ray.init`` ties its processes to
    this one: PR_SET_PDEATHSIG, and the raylet's workers end with it), but its dashboard and
    runtime-env agents outlived us by ~60 s: a watcher (``lifeline.reap_when_gone``) ends
    exactly the processes found now, by pid and start time. Replacing the last one lets it
    go (that instance was shut down before this one started)."""
    procs = _ray_processes()
    if procs:
        _ray_watch[:] = [reap_when_gone(procs)]


def ray_address_file() -> Path:
    """The file naming the Ray cluster last started on this machine, the one ``ray.init`` with
    no address or ``"auto"`` joins: ``ray_current_cluster`` in Ray's temp dir, which is
    ``$RAY_TMPDIR/ray`` (else ``$TMPDIR/ray``, else ``/tmp/ray``), not always ``/tmp/ray``."""
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # another Ray: the same rule, as Ray 2.60 has it
        base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
        return Path(base) / "ray" / "ray_current_cluster"
    return Path(get_ray_address_file(None))


def clear_stale_ray() -> bool:
    """Remove Ray's address file (:func:`ray_address_file`) when the GCS it names no longer
    answers (a killed run left it); a live cluster's file is left alone. True if one was
    removed."""
    pointer = ray_address_file()
    try:
        addr = pointer.read_text().strip()
    except OSError:
        return False
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=0.5):
            return False
    except (OSError, ValueError):
        pass
    pointer.unlink(missing_ok=True)
    return True


def worker_pythonpath() -> str:
    """PYTHONPATH for Ray workers and the service subprocess: this checkout first."""
    root = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join([root, *filter(None, os.environ.get("PYTHONPATH", "").split(":"))])


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in _ray.nodes() if n.get("Alive")]


# -- metadata service -----------------------------------------------------------------------

def serve_argv(config: ServiceSettings) -> list[str]:
    """``hkv serve`` with every service setting of ``config`` (``ServiceSettings.to_argv``:
    parsed back, the same object)."""
    return [sys.executable, "-m", "hkv_service.cli", "serve", *config.service().to_argv()]


def _spawn_service(config: ServiceSettings) -> subprocess.Popen[str]:
    """``hkv serve`` tied to this process (``hkv_service.lifeline``): it stops when this
    process ends, even by SIGKILL, instead of running on with no one to stop it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=worker_pythonpath())
    return spawn_tied(serve_argv(config), env, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)


def _await_listening(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """Wait for ``hkv serve: listening on HOST:PORT``; then keep draining its output."""
    assert proc.stdout is not None
    found: list[str] = []
    seen: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _LISTENING.search(line)
            if m and not found:
                found.append(f"{m.group(1)}:{m.group(2)}")
                ready.set()
            elif not found:
                seen.append(line.rstrip())
        ready.set()

    threading.Thread(target=pump, name="hkv-serve-output", daemon=True).start()
    ready.wait(timeout_s)
    if not found:
        _stop_process(proc)
        tail = " | ".join(seen[-3:]) or "no output"
        raise RuntimeError(f"metadata service did not start within {timeout_s:.0f}s: {tail}")
    return _dial(found[0], "127.0.0.1")  # a process on this machine: loopback reaches it


def _stop_process(proc: subprocess.Popen[str], grace_s: float = 10.0,
                  hurry: threading.Event | None = None) -> None:
    """SIGTERM (``hkv serve`` drains on it), wait up to ``grace_s`` (less once ``hurry`` is
    set), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            if hurry is not None and hurry.is_set():
                deadline = min(deadline, time.monotonic() + 1.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.2)
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
    let_go(proc)


def _dial(address: str, here: str) -> str:
    """The address clients dial for a service bound to ``address`` (HOST:PORT): ``here``
    (this node) for a wildcard bind, else the bound host itself."""
    host, _, port = address.rpartition(":")
    return f"{here}:{port}" if host in _WILDCARDS else address


def _serve_grace_s(config: SystemConfig) -> float:
    """The service's own stop grace (``--grace-s``)."""
    return config.grace_s


def _bounded_wait(refs: list[Any], timeout_s: float, hurry: threading.Event | None) -> None:
    """Wait for Ray calls to finish (their results or errors do not matter), at most
    ``timeout_s``, or 1 s more once ``hurry`` is set."""
    deadline = time.monotonic() + timeout_s
    pending = refs
    while pending:
        if hurry is not None and hurry.is_set():
            deadline = min(deadline, time.monotonic() + 1.0)
        left = deadline - time.monotonic()
        if left <= 0:
            return
        _ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(0.25, left))


# -- processes of a local Ray instance --------------------------------------------------------

def _ray_processes() -> dict[int, int]:
    """The processes of the local Ray instance this process started (gcs, raylet, agents and
    every descendant of theirs: the workers), pid -> start time. Empty where unknown."""
    roots: list[int] = []
    with contextlib.suppress(Exception):
        node = _ray._private.worker._global_node
        for infos in node.all_processes.values():
            roots += [info.process.pid for info in infos]
    if not roots or not Path("/proc").is_dir():
        return {}
    table = {int(p.name): st for p in Path("/proc").iterdir() if p.name.isdigit()
             if (st := proc_stat(int(p.name))) is not None}
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _start) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = [p for p in roots if p in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][1]
            todo += kids.get(pid, [])
    return found


class _ServiceHost:
    """The metadata service inside a detached Ray actor (``--address`` mode), started from
    the service settings whole, exactly as ``hkv serve`` starts it (``start_service``)."""

    def __init__(self, settings: ServiceSettings, inputs: ServiceInputs) -> None:
        from hkv_service.server.serve import start_service

        logging.basicConfig(level=logging.INFO)
        self.running = start_service(settings, inputs, own_process=True)

    def settings(self) -> ServiceSettings:
        return self.running.settings

    def address(self) -> tuple[str, str]:
        """(what the service is bound to, what clients dial: this node's IP for a wildcard
        bind), both HOST:PORT."""
        bound = self.running.address
        return bound, _dial(bound, _ray.util.get_node_ip_address())

    def drain(self) -> None:
        """Health NOT_SERVING; RPCs are still answered until :meth:`close`."""
        self.running.drain()

    def close(self, grace_s: float) -> None:
        self.running.close(grace_s).wait(grace_s + 1.0)


def _service_actor(config: SystemConfig, settings: ServiceSettings, inputs: ServiceInputs,
                   index: int) -> tuple[Any, str, str]:
    """The service actor of partition ``index``, on this node (the files it was given were
    read here, and the endpoint printed is this node's); one left by an earlier hkv up is
    taken over only if it runs with the same settings. Returns (actor, bound address, dial
    address)."""
    name = SERVICE_ACTOR if config.service_replicas == 1 else f"{SERVICE_ACTOR}-{index}"
    here = _this_node()
    pin = {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)} if here else {}
    actor_cls: Any = ray.remote(num_cpus=0, max_restarts=0)(_ServiceHost)
    actor = actor_cls.options(name=name, namespace=NAMESPACE, lifetime="detached",
                              get_if_exists=True, **pin).remote(settings, inputs)
    running = ray.get(actor.settings.remote(), timeout=config.start_timeout_s)
    if running != settings:
        raise RuntimeError(f"a metadata service actor {name!r} (namespace "
                           f"{NAMESPACE!r}) already runs on this cluster with other settings "
                           "(another hkv up, or one a killed hkv up left): stop that first")
    bound, dial = ray.get(actor.address.remote(), timeout=config.start_timeout_s)
    return actor, str(bound), str(dial)


def _this_node() -> str | None:
    """The Ray node this driver runs on (None where Ray cannot say, e.g. a ray:// client)."""
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None


def _check_reachable(config: SystemConfig) -> None:
    """A service bound to loopback is reached only from its own node: refuse to place shards
    that could not reach it (they would fail one by one, later, less clearly)."""
    here = _this_node()
    if not is_loopback(config.host) or here is None:
        return
    away = [n["NodeID"][:8] for n in _shard_nodes(config) if n["NodeID"] != here]
    if away:
        raise RuntimeError(f"the metadata service is bound to loopback ({config.host}) but "
                           f"shards go to other nodes ({', '.join(away)}): give --host "
                           "0.0.0.0 (with --auth-token-file or --tls-cert/--tls-key)")


# -- shards ---------------------------------------------------------------------------------

def shard_actor_class(max_restarts: int = 1, max_task_retries: int = 0) -> Any:
    """``ShardActor`` as a Ray actor class: restarted ``max_restarts`` times after a crash
    (re-running ``__init__``: it comes back empty). A call the crash interrupted is not
    retried on the successor: its pools are empty, so a read there could only answer STALE and
    a write only fail; failing at once tells the caller what happened (OWNER_LOST, the owner
    is marked lost) and it recomputes."""
    return ray.remote(num_cpus=0, max_restarts=max_restarts,
                      max_task_retries=max_task_retries)(ShardActor)


def place_shards(config: SystemConfig, endpoint: str, token: str | None = None,
                 metadata: Any = None, existing: Mapping[str, Any] | None = None,
                 tls: TlsConfig | None = None, keys: dict[str, str] | None = None
                 ) -> dict[str, Any]:
    """One shard per alive node (``shards_per_node`` each), pinned there by node affinity,
    named ``shard-<key>-<k>`` after the node's disk key (:func:`node_keys`: its disk tier is
    ``DATA_DIR/<name>``, found again by every run); shards in ``existing`` are skipped, so
    calling it again places shards on nodes that joined since. ``keys``: node id -> key, kept
    by the caller across calls (``System.node_keys``), updated here. ``metadata`` overrides
    the endpoint (e.g. a MetadataActor handle in tests); ``token`` and ``tls`` are how shards
    reach the service (``System.token``/``tls``)."""
    cls = shard_actor_class(config.max_restarts)
    shards: dict[str, Any] = {}
    nodes = _shard_nodes(config)
    keys = node_keys(nodes, str(Path(config.data_dir).resolve()), config.start_timeout_s, keys)
    for node in nodes:
        for k in range(config.shards_per_node):
            sid = f"{SHARD_PREFIX}{keys[node['NodeID']]}-{k}"
            if existing is not None and sid in existing:
                continue
            cfg = ShardConfig.from_settings(
                config, sid, metadata if metadata is not None else endpoint, token=token,
                tls=tls, node_id=node["NodeID"])
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            shards[sid] = cls.options(name=sid, namespace=NAMESPACE,
                                      scheduling_strategy=strategy).remote(cfg)
    ray.get([a.ping.remote() for a in shards.values()], timeout=config.start_timeout_s)
    return shards


_tier_keys_task: Any = ray.remote(num_cpus=0)(tier_keys)  # runs on the node it is pinned to


def node_keys(nodes: list[dict[str, Any]], data_dir: str, timeout_s: float,
              known: dict[str, str] | None = None) -> dict[str, str]:
    """Node id -> the key its shards' disk tiers are named after (:mod:`workers.nodekey`):
    the keys found in the node's data dir, read by a Ray task pinned there, divided among
    ``nodes`` (one each; a new key where none is left). ``known`` is updated in place: only
    nodes new to it are asked; nodes no longer in ``nodes`` are forgotten, so one that comes
    back (a new Ray node id, the same disk) finds its key again."""
    keys = known if known is not None else {}
    alive = {n["NodeID"] for n in nodes}
    for gone in [n for n in keys if n not in alive]:
        del keys[gone]
    todo = [n["NodeID"] for n in nodes if n["NodeID"] not in keys]
    pin = [NodeAffinitySchedulingStrategy(n, soft=False) for n in todo]
    refs = [_tier_keys_task.options(scheduling_strategy=p).remote(data_dir) for p in pin]
    found = ray.get(refs, timeout=timeout_s)
    keys.update(assign_keys(zip(todo, found, strict=True), taken=keys.values()))
    return keys


def _shard_nodes(config: SystemConfig) -> list[dict[str, Any]]:
    """Alive nodes that get shards. On a real cluster (``--address``) the head is left out
    once a worker exists: the head runs the service; the GPUs are on the workers."""
    nodes = _alive_nodes()
    if config.address is None:
        return nodes
    workers = [n for n in nodes if _HEAD_RESOURCE not in n.get("Resources", {})]
    return workers or nodes


def dead_service_actors(system: System, timeout_s: float = 5.0) -> list[int]:
    """Partitions whose service actor (--address) died: Ray answers ActorDiedError."""
    refs = [actor.address.remote() for actor in system.service_actors]
    dead = []
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.ActorDiedError:
            dead.append(i)
        except Exception:  # busy: asked again next time
            pass
    return dead


def dead_shards(system: System, timeout_s: float = 5.0) -> list[str]:
    """Shards whose actor died for good (its restarts used up): Ray answers ActorDiedError.
    One that is only restarting or slow is not dead."""
    refs = {sid: actor.ping.remote() for sid, actor in system.shards.items()}
    dead = []
    for sid, ref in refs.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.ActorDiedError:
            dead.append(sid)
        except Exception:  # restarting, or busy: asked again next time
            pass
    return sorted(dead)


def reconcile_shards(system: System, emit: Emit) -> None:
    """Replace shards that died for good (a new actor of the same name on the same node: a new
    incarnation, empty pools, the node's disk tier re-confirmed), and place shards on nodes
    that joined after start-up (KubeRay workers come up after the head); called periodically
    by ``hkv up``. A shard whose replacements within the window are used up (a crash loop) is
    left dead in ``system.shards``, which keeps its node from getting another, until the
    window has room again; it is reported once."""
    for sid in dead_shards(system):
        if not system.shard_budget(sid).spend(system.clock()):
            if sid not in system.held:
                system.held.add(sid)
                emit(f"shard {sid} died for good again after "
                     f"{system.config.shard_replacements} replacement(s) within "
                     f"{system.config.restart_window_s:g} s (--shard-replacements, "
                     "--restart-window-s): a crash loop; not replacing it until the window "
                     "has room")
            continue
        system.held.discard(sid)
        system.shards.pop(sid, None)
        system.replaced[sid] = system.replaced.get(sid, 0) + 1
        emit(f"shard {sid} died for good (restarts used up); placing a new one")
    try:
        added = place_shards(system.config, system.endpoint, system.token,
                             existing=system.shards, tls=system.tls, keys=system.node_keys)
    except Exception as exc:  # a node that failed to take a shard: try next time
        emit(f"could not place a shard ({type(exc).__name__}: {exc}); trying again")
        return
    system.shards.update(added)
    if added:
        emit(f"{len(added)} shard(s) placed: {', '.join(sorted(added))}")
