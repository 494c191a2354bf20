"""The two wirings of the real parts the demo drives (one :class:`~.backend.DemoBackend` over
either). Both give the backend the same things: a metadata port, a :class:`DataPlane`, the
transition stream, and the real faults a wiring can cause.

* :class:`InProcessWiring`: :class:`workers.inprocess.InProcessSystem` (a ``CacheState``
  behind the local port, real ``ShardActor`` s with their LMDB tiers in a temp dir, in-process
  links). A shard crash is its link killed; a service restart a fresh state swapped in.
* :class:`SystemWiring`: what ``hkv up`` starts (a local Ray, ``hkv serve`` as a subprocess,
  shard actors), through the gRPC client. A shard crash is SIGKILL of the actor's process (Ray
  restarts it); a service restart is the ``hkv serve`` process killed and started again on its
  port under the live shards.

Each can add a shard whose pools are only 32-byte aligned (``odd_shard``): a writer placing
blocks there makes handles a 128-byte-aligned reader must refuse (misaligned_handle), and each
can run the metadata view as ``partitions`` partitions (``hkv up --service-replicas``): the
transition stream is then every partition's, merged (:class:`MergedEvents`), and a service
restart restarts every partition.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hkv_service.core.api import AdmissionCap, StateConfig, TransitionEvent
from hkv_service.core.layout import Layout
from hkv_service.core.port import MetadataPort
from hkv_service.core.spec import CacheSpec
from workers.dataplane import DataPlane
from workers.inprocess import ODD_PAD, ODD_SHARD, InProcessConfig, InProcessSystem
from workers.shard import REGISTRATIONS

__all__ = ["InProcessWiring", "SystemWiring", "Wiring"]

Emit = Callable[[str], None]
ADMISSION = AdmissionCap(max_objects=64, max_bytes=1 << 28)
HEARTBEAT_TIMEOUT_S = 8.0  # shards beat every 2 s: a restarted service is rejoined within it
# How long a shard's restart by Ray may take: seconds when the host is quiet, but at load 16-25
# on 2 cores a restart (process, LMDB open, registration, re-confirm) was seen past 60 s in CI
# runs (test_demo_system seed 7: State=RESTARTING); a bound, not the expected time.
REVIVE_WAIT_S = 180.0
EVENTS_BATCH = 4096  # transitions one poll returns at most


Pull = Callable[[int, float], list[TransitionEvent]]  # one partition's events after a seq


class MergedEvents:
    """One transition stream over the partitions' streams, renumbered 1, 2, ... so the
    backend's cursor stays one number. Each partition's events keep their order, and an
    object never moves between partitions, so any interleaving of the streams is a valid
    order of events. ``reset`` (the partitions restarted) starts the numbering again; a
    cursor from before it gets nothing until the backend resets its own to 0."""

    def __init__(self, pulls: list[Pull]) -> None:
        self.pulls = pulls
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with getattr(self, "_lock", contextlib.nullcontext()):
            self._cursors = [0] * len(self.pulls)
            self._numbered = 0
            self._pending: deque[TransitionEvent] = deque()

    def since(self, seq: int, timeout_s: float) -> list[TransitionEvent]:
        with self._lock:
            if seq > self._numbered:
                return []  # a cursor from before a reset
            while self._pending and self._pending[0].seq <= seq:
                self._pending.popleft()
            if not self._pending:
                for i, pull in enumerate(self.pulls):
                    for ev in pull(self._cursors[i], timeout_s / len(self.pulls)):
                        self._cursors[i] = ev.seq
                        self._numbered += 1
                        self._pending.append(ev._replace(seq=self._numbered))
            return list(self._pending)[:EVENTS_BATCH]


class Wiring:
    """What the backend needs of a wiring (both below implement all of it)."""

    name: str
    meta: MetadataPort
    dp: DataPlane
    odd_shard: str | None
    restarts: int

    def events(self, seq: int, timeout_s: float) -> list[TransitionEvent]:
        raise NotImplementedError

    def crash_shard(self, sid: str) -> None:
        raise NotImplementedError

    def revive_shard(self, sid: str) -> int:
        raise NotImplementedError

    def restart_service(self) -> None:
        raise NotImplementedError

    def shard_dir(self, sid: str) -> Path:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return self.meta.stats()  # type: ignore[attr-defined, no-any-return]

    def close(self) -> None:
        raise NotImplementedError


class InProcessWiring(Wiring):
    name = "inprocess"

    def __init__(self, spec: CacheSpec, pool_blocks: int, odd_shard: bool = False,
                 partitions: int = 1, range_blocks: int = 0) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="hkv-demo-"))
        config = InProcessConfig(
            shards=2, blocks_per_group=pool_blocks, admission=ADMISSION, odd_shard=odd_shard,
            state=StateConfig(ADMISSION, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                              range_blocks=range_blocks),
            partitions=partitions,
        )
        try:
            self.system = InProcessSystem(spec, self._dir, config)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.meta = self.system.meta
        self.dp = self.system.dataplane(timeout_s=15.0)
        self.odd_shard = ODD_SHARD if odd_shard else None
        self.restarts = 0
        self._merged = MergedEvents([
            lambda seq, _t, part=part: part.events_since(seq, EVENTS_BATCH)  # type: ignore[misc]
            for part in self.system.parts])

    def events(self, seq: int, timeout_s: float) -> list[TransitionEvent]:
        got = self._merged.since(seq, timeout_s)
        if not got:
            time.sleep(min(timeout_s, 0.01))
        return got

    def crash_shard(self, sid: str) -> None:
        self.system.crash_shard(sid)

    def revive_shard(self, sid: str) -> int:
        return self.system.revive_shard(sid)

    def restart_service(self) -> None:
        self.system.restart_service()
        self._merged.reset()
        self.restarts += 1

    def shard_dir(self, sid: str) -> Path:
        return self.system.shard_dir(sid)

    def close(self) -> None:
        try:
            self.system.close()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


class SystemWiring(Wiring):
    name = "system"

    def __init__(self, spec: CacheSpec, pool_blocks: int, odd_shard: bool = False,
                 emit: Emit | None = None, data_dir: str = "hkv-data",
                 start_timeout_s: float = 90.0, partitions: int = 1,
                 range_blocks: int = 0, spec_file: str | None = None) -> None:
        """``spec_file``: the packaged spec (``hkv_service/data``) ``hkv up`` serves, which
        must be ``spec``; None: the service's default."""
        import ray

        from workers.launcher import (
            SystemConfig,
            init_local_ray,
            start_system,
            worker_pythonpath,
        )
        from workers.raylink import NAMESPACE

        self.say = emit or (lambda _msg: None)
        self.restarts = 0
        self.pids: list[int] = []
        self.system: Any = None
        self._ray_started = False
        self._data_dir = Path(data_dir).resolve()
        self._closed = False
        self.odd_shard = ODD_SHARD if odd_shard else None
        self._watchers: list[Any] = []
        self._killed: dict[str, int] = {}  # pid of each crashed shard
        try:
            if not ray.is_initialized():
                self.say("starting a local Ray instance")
                init_local_ray(address="local", include_dashboard=False, log_to_driver=False,
                               namespace=NAMESPACE, num_cpus=max(2, os.cpu_count() or 2),
                               runtime_env={"env_vars": {"PYTHONPATH": worker_pythonpath()}})
                self._ray_started = True
                self.pids += _ray_pids()
            self.config = SystemConfig(
                port=0, data_dir=str(self._data_dir), blocks_per_group=pool_blocks,
                disk_budget_bytes=1 << 30, shards_per_node=2, max_restarts=1000, device="auto",
                start_timeout_s=start_timeout_s, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                max_inflight_objects=ADMISSION.max_objects,
                max_inflight_bytes=ADMISSION.max_bytes, service_replicas=partitions,
                range_blocks=range_blocks, spec=_packaged(spec_file),
            )
            self.system = start_system(self.config, self.say)
            self.pids += [p.pid for p in self.system.services]
            if odd_shard:
                self._place_odd_shard()
            self.meta = self.system.metadata()
            from hkv_service.client import MetadataClient

            self._watchers = [MetadataClient(e, token=self.system.token, tls=self.system.tls)
                              for e in self.system.endpoints]
            self._merged = MergedEvents([self._pull(c) for c in self._watchers])
            self.dp = self.system.dataplane(timeout_s=15.0)
            names = {c.name for c in self.dp.layout.columns}
            if names != {c.name for c in Layout(spec).columns}:
                raise RuntimeError(f"the service runs another cache spec (columns {names})")
        except BaseException:
            self.close()
            raise

    def _place_odd_shard(self) -> None:
        import ray

        from workers.launcher import shard_actor_class
        from workers.raylink import NAMESPACE
        from workers.shard import ShardConfig

        c = self.config
        cfg = ShardConfig.from_settings(c, ODD_SHARD, self.system.endpoint,
                                        token=self.system.token, tls=self.system.tls,
                                        pool_stride_pad=ODD_PAD)
        actor = shard_actor_class(c.max_restarts).options(
            name=ODD_SHARD, namespace=NAMESPACE).remote(cfg)
        ray.get(actor.ping.remote(), timeout=c.start_timeout_s)
        self.system.shards[ODD_SHARD] = actor

    def _ping(self, sid: str, timeout_s: float = 10.0) -> dict[str, Any]:
        import ray

        return ray.get(self.system.shards[sid].ping.remote(), timeout=timeout_s)  # type: ignore[no-any-return]

    @staticmethod
    def _pull(client: Any) -> Pull:
        def pull(seq: int, timeout_s: float) -> list[TransitionEvent]:
            out = []
            for ev in client.watch(seq, timeout_s=timeout_s):
                out.append(ev)
                if len(out) >= EVENTS_BATCH:
                    break
            return out
        return pull

    def events(self, seq: int, timeout_s: float) -> list[TransitionEvent]:
        return self._merged.since(seq, timeout_s)

    def crash_shard(self, sid: str) -> None:
        """SIGKILL of the shard actor's process (Ray restarts it: max_restarts), once it
        answers: a kill injected while Ray is still restarting it from the one before waits
        for the process to kill (the ping failed with ActorUnavailableError and the demo
        ended with a traceback and no report: seen on the system wiring, seed 6)."""
        pid = int(self._answering(sid)["pid"])
        self._killed[sid] = pid
        os.kill(pid, signal.SIGKILL)

    def _answering(self, sid: str) -> dict[str, Any]:
        """The shard's ping answer, waiting up to REVIVE_WAIT_S for a restart in progress."""
        deadline = time.monotonic() + REVIVE_WAIT_S
        while True:
            try:
                return self._ping(sid)
            except Exception as exc:  # restarting (ActorUnavailableError), or slow
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard {sid} did not answer within "
                                       f"{REVIVE_WAIT_S:.0f} s (Ray: {self._actor_state(sid)}; "
                                       f"last ping: {type(exc).__name__}: {exc})") from exc
                time.sleep(0.2)

    def revive_shard(self, sid: str) -> int:
        """Wait until Ray has restarted the shard: a ping answered by another process (it
        answers once ``__init__``, registration included, is done)."""
        killed = self._killed.pop(sid, None)
        deadline = time.monotonic() + REVIVE_WAIT_S
        last: object = "no ping answered"
        while time.monotonic() < deadline:
            try:
                info = self._ping(sid)
            except Exception as exc:  # the actor restarting, or dead: said if it never comes
                last = f"{type(exc).__name__}: {exc}"
            else:
                if int(info["pid"]) != killed:
                    return int(info["incarnation"])
                last = f"the killed process {killed} still answers"
            time.sleep(0.2)
        raise TimeoutError(f"shard {sid} did not come back within {REVIVE_WAIT_S:.0f} s "
                           f"(Ray: {self._actor_state(sid)}; last ping: {last})")

    def _actor_state(self, sid: str) -> str:
        """Ray's record of the shard actor (state, restarts, death cause), for the error."""
        try:
            from ray._private import state  # no public call without the dashboard

            rec = state.actors(self.system.shards[sid]._actor_id.hex())
            return ", ".join(f"{k}={rec.get(k)}" for k in
                             ("State", "NumRestarts", "DeathCause", "Pid", "Address"))
        except Exception as exc:
            return f"unknown ({type(exc).__name__}: {exc})"

    def restart_service(self) -> None:
        """Kill ``hkv serve`` and start it again on its port; wait for every shard to rejoin."""
        before = {sid: _registrations(a) for sid, a in self.system.shards.items()}
        self.system.restart_service(self.say)
        self._merged.reset()
        self.pids += [p.pid for p in self.system.services]
        self.restarts += 1
        deadline = time.monotonic() + REVIVE_WAIT_S
        for sid, actor in self.system.shards.items():
            while _registrations(actor) <= before[sid]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard {sid} did not rejoin the restarted service")
                time.sleep(0.1)

    def shard_dir(self, sid: str) -> Path:
        return self._data_dir / sid

    def close(self) -> None:
        """Stop the shards, the service and Ray (if ours); remove the shards' data directories
        this run created. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for client in (getattr(self, "meta", None), *self._watchers):
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
        shard_ids = list(self.system.shards) if self.system is not None else []
        if self.system is not None:
            with contextlib.suppress(Exception):
                self.system.stop(self.say)
        import ray

        if self._ray_started and ray.is_initialized():
            ray.shutdown()
        for sid in shard_ids:
            shutil.rmtree(self._data_dir / sid, ignore_errors=True)
        with contextlib.suppress(OSError):
            self._data_dir.rmdir()  # only if this run left it empty


def _registrations(actor: Any) -> int:
    """The shard's registrations that landed (a rejoin begun may still be registering with
    the view before: see ``InProcessSystem.restart_service``)."""
    import ray

    try:
        stats = ray.get(actor.stats.remote(), timeout=10.0)
    except Exception:
        return -1
    return int(stats["counts"].get(REGISTRATIONS, 0))


def _ray_pids() -> list[int]:
    """Pids of the Ray processes (gcs, raylet, ...) this driver's ray.init started."""
    try:
        import ray

        node: Any = ray._private.worker._global_node
        out = []
        for infos in node.all_processes.values():
            for info in infos:
                if info.process is not None:
                    out.append(int(info.process.pid))
        return out
    except Exception:
        return []


def _packaged(name: str | None) -> str | None:
    """The path of a spec file packaged with hkv_service (an installed or editable tree)."""
    if name is None:
        return None
    from importlib import resources

    return str(resources.files("hkv_service") / "data" / name)
