"""``hkv up``: the metadata service, one cache shard per Ray node, each node's disk tier.

:func:`start_system` brings the parts up and returns a :class:`System`; ``System.stop()``
takes everything down again (shards killed, service stopped by pid, Ray shut down if we
started it): nothing is left running. :func:`run_up` is the CLI around them::

    ray (local instance, or --address)  ->  metadata service (subprocess `hkv serve`, or a
    detached named Ray actor with --address)  ->  shards (node affinity, one per alive node)
    -> print the endpoint -> wait for SIGINT/SIGTERM -> stop

SIGTERM and SIGINT both drain and exit 0: the service's health goes NOT_SERVING first, then
the shards are stopped, then the service, then Ray (a local instance with all its processes).
``ray.init`` installs its own SIGTERM handler (exit at once, ``hkv serve`` left running), so
ours is put back right after it and re-asserted while waiting. The handler only sets an event;
a second signal during the drain makes the waits shorter, never skips a step.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hkv_service.core.admission import AdmissionCap

from .dataplane import DataPlane
from .shard import ShardActor, ShardConfig

__all__ = [
    "System", "SystemConfig", "clear_stale_ray", "config_from_args", "init_local_ray", "run_up",
    "start_system", "worker_pythonpath",
]

log = logging.getLogger(__name__)

NAMESPACE = "hkv"
_ray: Any = ray  # some ray entry points are untyped
RAY_CURRENT = Path("/tmp/ray/ray_current_cluster")
_HEAD_RESOURCE = "node:__internal_head__"  # ray's marker resource of the head node
RECONCILE_EVERY_TICKS = 10  # hkv up looks for newly joined nodes every 5 s
_LISTENING = re.compile(r"listening on (\S+):(\d+)")
Emit = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class SystemConfig:
    host: str = "127.0.0.1"
    port: int = 0
    data_dir: str = "hkv-data"
    spec: str | None = None
    auth_token_file: str | None = None
    heartbeat_timeout_s: float = 10.0
    blocks_per_group: int = 256
    disk_budget_bytes: int = 1 << 30
    max_inflight_objects: int = 64
    max_inflight_bytes: int = 256 << 20
    lookup_memo_mib: int = 64
    walk_segment_blocks: int | None = None  # None: the spec's own default (segment_blocks_for)
    shards_per_node: int = 1
    address: str | None = None
    num_cpus: int | None = None
    max_restarts: int = 1
    device: str = "auto"
    serve_args: tuple[str, ...] = ()  # extra `hkv serve` flags (TLS, --insecure, metrics)
    start_timeout_s: float = 60.0


@dataclass(slots=True)
class System:
    config: SystemConfig
    endpoint: str
    shards: dict[str, Any] = field(default_factory=dict)
    service: subprocess.Popen[str] | None = None
    service_actor: Any = None
    ray_started: bool = False
    token: str | None = None

    def metadata(self) -> Any:
        from hkv_service.client import MetadataClient

        return MetadataClient(self.endpoint, token=self.token)

    def dataplane(self, timeout_s: float = 10.0) -> DataPlane:
        return DataPlane(self.metadata(), self.shards, timeout_s)

    def stop(self, emit: Emit | None = None, hurry: threading.Event | None = None) -> None:
        """Drain and stop everything, each wait bounded; idempotent. Health NOT_SERVING first
        (``hkv serve`` drains on SIGTERM; the actor is told), then shards (``shutdown`` then
        ``ray.kill``), then the service (SIGKILL past its grace), then Ray if we started it,
        with every process of it. ``hurry`` set (a second signal) cuts the waits short."""
        say = emit or (lambda _msg: None)
        if self.service is not None and self.service.poll() is None:
            self.service.send_signal(signal.SIGTERM)
            say(f"metadata service (pid {self.service.pid}) draining: health NOT_SERVING")
        if self.service_actor is not None:
            with contextlib.suppress(Exception):
                _bounded_wait([self.service_actor.drain.remote()], 5.0, hurry)
                say("metadata service draining: health NOT_SERVING")
        shards = list(self.shards.items())
        with contextlib.suppress(Exception):
            _bounded_wait([actor.shutdown.remote() for _sid, actor in shards], 5.0, hurry)
        for sid, actor in shards:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            say(f"shard {sid} stopped")
        self.shards.clear()
        if self.service is not None:
            _stop_process(self.service, _serve_grace_s(self.config) + 5.0, hurry)
            say(f"metadata service (pid {self.service.pid}) stopped")
            self.service = None
        if self.service_actor is not None:
            with contextlib.suppress(Exception):
                grace = _serve_grace_s(self.config)
                _bounded_wait([self.service_actor.close.remote(grace)], grace + 5.0, hurry)
            with contextlib.suppress(Exception):
                ray.kill(self.service_actor, no_restart=True)
            self.service_actor = None
            say("metadata service stopped")
        if self.ray_started and ray.is_initialized():
            ours = _ray_processes()
            ray.shutdown()
            _reap(ours, 1.0 if hurry is not None and hurry.is_set() else 5.0)
            self.ray_started = False
            say("ray stopped")


def start_system(config: SystemConfig, emit: Emit | None = None,
                 after_ray_init: Callable[[], None] | None = None) -> System:
    """``after_ray_init`` runs as soon as Ray is up (``hkv up`` puts its signal handlers
    back there: ``ray.init`` replaces them)."""
    say = emit or (lambda _msg: None)
    started = _init_ray(config)
    if after_ray_init is not None:
        after_ray_init()
    say(f"ray: {'started a local instance' if started else 'joined'} "
        f"({len(_alive_nodes())} node(s))")
    token = Path(config.auth_token_file).read_text().strip() if config.auth_token_file else None
    system = System(config, "", ray_started=started, token=token)
    try:
        if config.address is None:
            system.service = _spawn_service(config)
            system.endpoint = _await_listening(system.service, config.start_timeout_s)
        else:
            system.service_actor, system.endpoint = _service_actor(config)
        say(f"metadata service listening on {system.endpoint}")
        system.shards = place_shards(config, system.endpoint, token)
        say(f"{len(system.shards)} shard(s) up: {', '.join(sorted(system.shards))}")
    except BaseException:
        system.stop()
        raise
    return system


# -- ray ------------------------------------------------------------------------------------

def _init_ray(config: SystemConfig) -> bool:
    if ray.is_initialized():
        return False
    if config.address is not None:
        ray.init(address=config.address, namespace=NAMESPACE, include_dashboard=False)
        return False
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
            return
        except ConnectionError:
            RAY_CURRENT.unlink(missing_ok=True)
        except Exception as err:  # ray raises a bare Exception for the start-up timeout
            if "timed out during startup" not in str(err) or attempt == attempts:
                raise
            log.warning("ray start-up timed out (attempt %d/%d); retrying", attempt, attempts)
        ray.shutdown()
    ray.init(**kwargs)


def clear_stale_ray() -> bool:
    """Remove ``/tmp/ray/ray_current_cluster`` when the GCS it names no longer answers (a
    killed run left it); a live cluster's file is left alone. True if one was removed."""
    try:
        addr = RAY_CURRENT.read_text().strip()
    except OSError:
        return False
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=0.5):
            return False
    except (OSError, ValueError):
        pass
    RAY_CURRENT.unlink(missing_ok=True)
    return True


def worker_pythonpath() -> str:
    """PYTHONPATH for Ray workers and the service subprocess: this checkout first."""
    root = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join([root, *filter(None, os.environ.get("PYTHONPATH", "").split(":"))])


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in _ray.nodes() if n.get("Alive")]


# -- metadata service -----------------------------------------------------------------------

def serve_argv(config: SystemConfig) -> list[str]:
    argv = [sys.executable, "-m", "hkv_service.cli", "serve", "--host", config.host,
            "--port", str(config.port), "--data-dir", config.data_dir,
            "--heartbeat-timeout-s", str(config.heartbeat_timeout_s),
            "--max-inflight-objects", str(config.max_inflight_objects),
            "--max-inflight-bytes", str(config.max_inflight_bytes),
            "--lookup-memo-mib", str(config.lookup_memo_mib)]
    if config.walk_segment_blocks is not None:
        argv += ["--walk-segment-blocks", str(config.walk_segment_blocks)]
    if config.spec:
        argv += ["--spec", config.spec]
    if config.auth_token_file:
        argv += ["--auth-token-file", config.auth_token_file]
    return argv + list(config.serve_args)


def _spawn_service(config: SystemConfig) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=worker_pythonpath())
    return subprocess.Popen(serve_argv(config), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


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
    return found[0]


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


def _serve_grace_s(config: SystemConfig) -> float:
    """The service's own stop grace (``--grace-s``, passed through in ``serve_args``)."""
    args = list(config.serve_args)
    with contextlib.suppress(ValueError, IndexError):
        return max(0.0, float(args[args.index("--grace-s") + 1]))
    return 5.0


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

def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(ppid, start time) of a live process, from /proc; None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields_ = stat[stat.rindex(")") + 2:].split()
    if fields_[0] in ("Z", "X"):
        return None
    return int(fields_[1]), fields_[19]


def _ray_processes() -> dict[int, str]:
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
             if (st := _proc_stat(int(p.name))) is not None}
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _start) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = [p for p in roots if p in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][1]
            todo += kids.get(pid, [])
    return found


def _reap(procs: Mapping[int, str], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for ``procs`` (pid -> start time) to exit; SIGKILL the rest."""
    def alive() -> Iterable[int]:
        return [p for p, start in procs.items()
                if (st := _proc_stat(p)) is not None and st[1] == start]

    deadline = time.monotonic() + timeout_s
    left = list(alive())
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = list(alive())
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class _ServiceHost:
    """The metadata service inside a detached Ray actor (``--address`` mode)."""

    def __init__(self, config: SystemConfig) -> None:
        from hkv_service.core.state_view import CacheState, StateConfig
        from hkv_service.server.app import ServerConfig, build_service
        from hkv_service.specs import resolve_spec

        token = (Path(config.auth_token_file).read_text().strip()
                 if config.auth_token_file else None)
        cap = AdmissionCap(config.max_inflight_objects, config.max_inflight_bytes)
        settings = StateConfig(admission=cap, heartbeat_timeout_s=config.heartbeat_timeout_s,
                               memo_max_bytes=config.lookup_memo_mib << 20,
                               segment_blocks=config.walk_segment_blocks)
        state = CacheState(resolve_spec(config.spec), settings)
        self.service = build_service(ServerConfig(config.host, config.port, auth_token=token),
                                     state)
        self.service.server.start()
        self._stop = threading.Event()
        threading.Thread(target=self._expire, daemon=True).start()

    def _expire(self) -> None:
        while not self._stop.wait(1.0):
            self.service.state.expire_owners()

    def drain(self) -> None:
        """Health NOT_SERVING; RPCs are still answered until :meth:`close`."""
        self.service.set_serving(False)

    def close(self, grace_s: float) -> None:
        self._stop.set()
        self.service.stop(grace_s).wait(grace_s + 1.0)

    def endpoint(self) -> str:
        return f"{_ray.util.get_node_ip_address()}:{self.service.port}"


def _service_actor(config: SystemConfig) -> tuple[Any, str]:
    actor_cls: Any = ray.remote(num_cpus=0, max_restarts=0)(_ServiceHost)
    actor = actor_cls.options(name="hkv-metadata", namespace=NAMESPACE, lifetime="detached",
                              get_if_exists=True).remote(config)
    return actor, str(ray.get(actor.endpoint.remote(), timeout=config.start_timeout_s))


# -- shards ---------------------------------------------------------------------------------

def shard_actor_class(max_restarts: int = 1, max_task_retries: int = -1) -> Any:
    """``ShardActor`` as a Ray actor class: restarted ``max_restarts`` times after a crash
    (re-running ``__init__``: it comes back empty), calls retried (they are idempotent)."""
    return ray.remote(num_cpus=0, max_restarts=max_restarts,
                      max_task_retries=max_task_retries)(ShardActor)


def place_shards(config: SystemConfig, endpoint: str, token: str | None = None,
                 metadata: Any = None, existing: Mapping[str, Any] | None = None
                 ) -> dict[str, Any]:
    """One shard per alive node (``shards_per_node`` each), pinned there by node affinity;
    nodes in ``existing`` are skipped, so calling it again places shards on nodes that joined
    since. ``metadata`` overrides the endpoint (e.g. a MetadataActor handle in tests)."""
    cls = shard_actor_class(config.max_restarts)
    shards: dict[str, Any] = {}
    data_dir = str(Path(config.data_dir).resolve())
    cap = AdmissionCap(config.max_inflight_objects, config.max_inflight_bytes)
    for node in _shard_nodes(config):
        for k in range(config.shards_per_node):
            sid = f"shard-{node['NodeID'][:8]}-{k}"
            if existing is not None and sid in existing:
                continue
            cfg = ShardConfig(sid, metadata if metadata is not None else endpoint, data_dir,
                              config.blocks_per_group, config.disk_budget_bytes, cap,
                              heartbeat_interval_s=max(0.2, config.heartbeat_timeout_s / 4),
                              device=config.device, token=token)
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            shards[sid] = cls.options(name=sid, namespace=NAMESPACE,
                                      scheduling_strategy=strategy).remote(cfg)
    ray.get([a.ping.remote() for a in shards.values()], timeout=config.start_timeout_s)
    return shards


def _shard_nodes(config: SystemConfig) -> list[dict[str, Any]]:
    """Alive nodes that get shards. On a real cluster (``--address``) the head is left out
    once a worker exists: the head runs the service; the GPUs are on the workers."""
    nodes = _alive_nodes()
    if config.address is None:
        return nodes
    workers = [n for n in nodes if _HEAD_RESOURCE not in n.get("Resources", {})]
    return workers or nodes


def reconcile_shards(system: System, emit: Emit) -> None:
    """Place shards on nodes that joined after start-up (KubeRay workers come up after the
    head); called periodically by ``hkv up``."""
    with contextlib.suppress(Exception):  # a node that failed to take a shard: try next time
        added = place_shards(system.config, system.endpoint, system.token,
                             existing=system.shards)
        system.shards.update(added)
        if added:
            emit(f"{len(added)} shard(s) placed on new node(s): {', '.join(sorted(added))}")


# -- CLI ------------------------------------------------------------------------------------

_FLAG_KEYS = {f.name for f in fields(SystemConfig)} - {"serve_args", "max_restarts", "num_cpus",
                                                       "device", "start_timeout_s"}
_PASSTHROUGH = {"tls_cert": "--tls-cert", "tls_key": "--tls-key", "tls_ca": "--tls-ca",
                "metrics_port": "--metrics-port", "grace_s": "--grace-s"}


class ConfigError(Exception):
    """A --config file or flag value that cannot work; one sentence."""


def config_from_args(args: argparse.Namespace) -> SystemConfig:
    values = {k: getattr(args, k) for k in _FLAG_KEYS | set(_PASSTHROUGH) | {"insecure"}
              if hasattr(args, k)}
    if getattr(args, "config", None):
        values.update(_load_config_file(args.config, values, args))
    serve_args: list[str] = []
    defaults = _defaults()
    for key, flag in _PASSTHROUGH.items():
        value = values.pop(key, None)
        if value is not None and value != defaults.get(key):
            serve_args += [flag, str(value)]
    if values.pop("insecure", False):
        serve_args.append("--insecure")
    return SystemConfig(**values, serve_args=tuple(serve_args))


def _load_config_file(path: str, current: dict[str, Any], args: argparse.Namespace
                      ) -> dict[str, Any]:
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read --config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path} is not valid YAML: {str(exc).splitlines()[0]}") \
            from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path} must be a mapping of flag names to values")
    out: dict[str, Any] = {}
    known = set(current)
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"--config {path}: unknown key {key!r}")
        out[name] = value
    # Flags given on the command line win over the file.
    defaults = _defaults()
    return {k: v for k, v in out.items() if getattr(args, k, None) == defaults.get(k)}


def _defaults() -> dict[str, Any]:
    from hkv_service.cli import build_parser

    return vars(build_parser().parse_args(["up"]))


def run_up(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        _validate(config)
    except ConfigError as exc:
        sys.stderr.write(f"hkv up: error: {exc}\n")
        return 2
    say = _printer()
    stop = _StopSignals()
    stop.install()
    try:
        system = start_system(config, say, after_ray_init=stop.install)
    except Exception as exc:
        sys.stderr.write(f"hkv up: error: could not start: {exc}\n")
        _shutdown_ray()
        return 1
    except SystemExit:  # the signal came inside ray.init, to ray's handler: it exits
        _shutdown_ray()
        say("stopped")
        return 0
    stop.install()
    say(f"endpoint {system.endpoint}")
    code = _wait(system, stop, say)
    say("stopping")
    system.stop(say, stop.hurry)
    _shutdown_ray()  # --address: leave the cluster (shutting it down is not ours to do)
    say("stopped")
    return code


class _StopSignals:
    """The SIGTERM/SIGINT handler of ``hkv up``: it only sets events. The first signal asks
    for the drain (``requested``), a later one for a faster drain (``hurry``)."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.hurry = threading.Event()

    def __call__(self, signum: int, _frame: object) -> None:
        if self.requested.is_set():
            self.hurry.set()
        self.requested.set()

    def install(self) -> None:
        """(Re)install for SIGTERM and SIGINT, where something (``ray.init``) replaced it."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not self:
                signal.signal(sig, self)


def _shutdown_ray() -> None:
    with contextlib.suppress(Exception):
        if ray.is_initialized():
            ray.shutdown()


def _wait(system: System, stop: _StopSignals, say: Emit) -> int:
    """0 once a signal asks to stop; 1 if the service exits on its own."""
    ticks = 0
    while not stop.requested.wait(0.5):
        stop.install()
        if system.service is not None and system.service.poll() is not None:
            sys.stderr.write("hkv up: error: the metadata service exited\n")
            return 1
        ticks += 1
        if ticks % RECONCILE_EVERY_TICKS == 0:
            reconcile_shards(system, say)
    return 0


def _validate(config: SystemConfig) -> None:
    for name in ("blocks_per_group", "disk_budget_bytes", "max_inflight_objects",
                 "max_inflight_bytes", "shards_per_node"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, "
                              f"got {value!r}")
    if config.auth_token_file and not Path(config.auth_token_file).is_file():
        raise ConfigError(f"--auth-token-file {config.auth_token_file} is not a readable file")


def _printer() -> Emit:
    def say(msg: str) -> None:
        print(f"hkv up: {msg}", flush=True)

    return say
