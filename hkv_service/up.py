"""``hkv up``: flags and ``--config`` -> one SystemSettings, then the launcher; signals.

Every setting is checked (values, then the files it names and the spec) before Ray starts: a
bad one is exit 2 with one sentence. Then :func:`workers.launcher.start_system` brings the
system up, the endpoint is printed, and ``hkv up`` waits::

    flags + --config  ->  SystemSettings (checked)  ->  load (token, TLS, spec; checked)
    -> start_system -> "hkv up: endpoint HOST:PORT" -> wait for SIGINT/SIGTERM -> stop

SIGTERM and SIGINT both drain and exit 0: the service's health goes NOT_SERVING first, then
the shards are stopped, then the service, then Ray (a local instance with all its processes).
``ray.init`` installs its own SIGTERM handler (exit at once, ``hkv serve`` left running), so
ours is put back right after it and re-asserted while waiting. The handler only sets an event;
a second signal during the drain makes the waits shorter, never skips a step.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .settings import SettingsError, SystemSettings

if TYPE_CHECKING:
    from workers.launcher import Emit, System

__all__ = ["config_from_args", "run_up"]


def config_from_args(args: argparse.Namespace) -> SystemSettings:
    """The settings from the flags; a ``--config`` file fills what no flag gave."""
    path = getattr(args, "config", None)
    file = _load_config_file(path) if path else None
    return SystemSettings.from_args(args, file)


def _load_config_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise SettingsError(f"cannot read --config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"--config {path} is not valid YAML: {str(exc).splitlines()[0]}") \
            from None
    if not isinstance(raw, dict):
        raise SettingsError(f"--config {path} must be a mapping of flag names to values")
    return SystemSettings.from_mapping(raw, f"--config {path}")


def run_up(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        inputs = config.load()
        config.credentials(inputs)  # the client certificate files, read here once too
    except SettingsError as exc:
        sys.stderr.write(f"hkv up: error: {exc}\n")
        return 2
    from workers.launcher import start_system  # ray: only once the settings are known good

    say = _printer()
    if not config.guarded:
        say(f"warning: binding {config.host} without TLS or auth token (--insecure)")
    stop = _StopSignals()
    stop.install()
    try:
        system = start_system(config, say, after_ray_init=stop.install, inputs=inputs)
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
    say(f"worker: from workers.attach import attach; hkv = attach({system.endpoint!r}, "
        f"ray_address={_gcs_address()!r})")
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


def _gcs_address() -> str:
    """The Ray address a worker joins (``ray.init(address=...)``) to reach the shards."""
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return "auto"


def _shutdown_ray() -> None:
    import ray

    with contextlib.suppress(Exception):
        if ray.is_initialized():
            ray.shutdown()


def _wait(system: System, stop: _StopSignals, say: Emit) -> int:
    """0 once a signal asks to stop. A metadata service that exits on its own (its process, or
    its actor under --address) is started again on its port and the shards rejoin it, every
    time, as long as the restart budget allows (``--service-restarts`` within
    ``--restart-window-s``); a death past it is a crash loop: 1, with a sentence."""
    from workers.launcher import RECONCILE_EVERY_TICKS, dead_service_actors, reconcile_shards

    ticks = 0
    while not stop.requested.wait(0.5):
        stop.install()
        for i, proc in enumerate(system.services):
            if proc.poll() is None:
                continue
            which = "" if len(system.services) == 1 else f" partition {i}"
            if not _may_restart(system, f"metadata service{which} exited (code "
                                        f"{proc.returncode})", say):
                return 1
            _attempt(say, system.restart_service, say, partition=i)
        ticks += 1
        if ticks % RECONCILE_EVERY_TICKS == 0:
            for i in dead_service_actors(system) if system.service_actors else []:
                if not _may_restart(system, f"metadata service actor of partition {i} died",
                                    say):
                    return 1
                _attempt(say, system.restart_service_actor, i, say)
            reconcile_shards(system, say)
    return 0


def _may_restart(system: System, what: str, say: Emit) -> bool:
    """Spend one restart of the service's budget on ``what`` happened and say so; False, with
    the sentence on stderr, when the budget of the window is spent: a crash loop."""
    config, now = system.config, system.clock()
    limits = (f"--service-restarts {config.service_restarts} --restart-window-s "
              f"{config.restart_window_s:g}")
    if not system.service_budget.spend(now):
        sys.stderr.write(f"hkv up: error: {what} after {config.service_restarts} restart(s) "
                         f"within {config.restart_window_s:g} s ({limits}): a crash loop; "
                         "giving up\n")
        return False
    say(f"{what}; starting it again ({system.service_budget.used(now)}/"
        f"{config.service_restarts} within {config.restart_window_s:g} s)")
    return True


def _attempt(say: Emit, restart: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Run a restart; one that fails is said and left to the next tick, which finds the
    service dead again and spends the budget again (a service that cannot start is a crash
    loop too)."""
    try:
        restart(*args, **kwargs)
    except Exception as exc:
        say(f"could not restart the metadata service ({type(exc).__name__}: {exc}); trying "
            "again")


def _printer() -> Emit:
    def say(msg: str) -> None:
        print(f"hkv up: {msg}", flush=True)

    return say
