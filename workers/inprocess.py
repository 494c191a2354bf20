"""The in-process wiring of the real parts: one ``CacheState`` behind :class:`LocalMetadata`,
N real :class:`~workers.shard.ShardActor` s (torch block pools, each with its real LMDB
:class:`storage.DiskTier` under ``data_dir``), reached through :class:`InProcessLink` s.

It is what ``hkv up`` starts, minus the processes: the same data plane, shard and disk code
run, so a bug in them shows up here. Faults are real too:

* :meth:`InProcessSystem.kill_shard` crashes a shard and starts its successor on the same
  data directory (new incarnation, empty pools, its disk records re-confirmed), as Ray restarts
  an actor;
* :meth:`InProcessSystem.restart_service` swaps in a fresh ``CacheState``: every shard finds
  out from its next heartbeat (``UnknownOwner``) and goes through its real rejoin path. With
  ``partitions`` > 1 the view is that many partitions behind a ``PartitionedMetadata`` (as
  ``hkv up --service-replicas N``), and one of them can be restarted alone.

Used by the demo (``hkv demo --backend inprocess``), ``hkv bench e2e`` and tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from hkv_service.core.api import AdmissionCap, StateConfig, TransitionEvent
from hkv_service.core.partitions import Partition
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.settings import SYSTEM_DEFAULTS

from .dataplane import DataPlane
from .link import InProcessLink, ShardUnavailable
from .local import LocalMetadata
from .partitioned import PartitionedMetadata
from .shard import REGISTRATIONS, ShardActor, ShardConfig

__all__ = ["ODD_SHARD", "InProcessConfig", "InProcessSystem"]

ODD_SHARD = "shard-odd"  # the shard with padded pools (InProcessConfig.odd_shard)
ODD_PAD = 32  # its pools' pad: blocks 32-byte aligned, no more


@dataclass(frozen=True, slots=True)
class InProcessConfig:
    shards: int = 2
    blocks_per_group: int = SYSTEM_DEFAULTS.blocks_per_group
    disk_budget_bytes: int = SYSTEM_DEFAULTS.disk_budget_bytes
    heartbeat_interval_s: float = 0.2  # (in process: a restart is rejoined at once)
    admission: AdmissionCap = field(default_factory=AdmissionCap)
    state: StateConfig = field(default_factory=lambda: StateConfig(heartbeat_timeout_s=30.0))
    odd_shard: bool = False  # one more shard whose pools are only 32-byte aligned
    device: str = "cpu"  # (not hkv up's "auto": in-process runs are tests and benches)
    partitions: int = 1  # metadata partitions (core/partitions.py)
    worker_claims: bool = True  # ShardConfig.worker_claims


class InProcessSystem:
    def __init__(self, spec: CacheSpec, data_dir: str | Path,
                 config: InProcessConfig | None = None) -> None:
        self.spec = spec
        self.config = config or InProcessConfig()
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.parts = [LocalMetadata(self._fresh_state(i))
                      for i in range(self.config.partitions)]
        self.meta: LocalMetadata | PartitionedMetadata = (
            self.parts[0] if len(self.parts) == 1 else PartitionedMetadata(self.parts))
        self.links: dict[str, InProcessLink] = {}
        self.restarts = 0
        names = [f"shard-{i}" for i in range(self.config.shards)]
        if self.config.odd_shard:
            names.append(ODD_SHARD)
        try:
            for sid in names:
                self.links[sid] = InProcessLink(sid, ShardActor(self.shard_config(sid)))
        except BaseException:
            self.close()
            raise

    def shard_config(self, sid: str) -> ShardConfig:
        c = self.config
        return ShardConfig(
            sid, self.meta, str(self.data_dir), blocks_per_group=c.blocks_per_group,
            disk_budget_bytes=c.disk_budget_bytes, admission=c.admission,
            heartbeat_interval_s=c.heartbeat_interval_s, device=c.device,
            node_id="in-process", pool_stride_pad=ODD_PAD if sid == ODD_SHARD else 0,
            worker_claims=c.worker_claims,
        )

    def dataplane(self, timeout_s: float = 10.0) -> DataPlane:
        return DataPlane(self.meta, self.links, timeout_s)

    def shard_dir(self, sid: str) -> Path:
        return self.data_dir / sid

    def incarnation(self, sid: str) -> int:
        return int(self.links[sid].shard.incarnation)

    # -- faults ---------------------------------------------------------------------------

    def kill_shard(self, sid: str) -> int:
        """Crash shard ``sid`` and start its successor; returns the successor's incarnation."""
        self.crash_shard(sid)
        return self.revive_shard(sid)

    def crash_shard(self, sid: str) -> None:
        """Shard ``sid`` dies: calls to it fail (ShardUnavailable) until it is revived."""
        self.links[sid].kill()

    def revive_shard(self, sid: str) -> int:
        """Start the successor of crashed shard ``sid`` on the same link (empty pools, the same
        disk tier: it registers, is a new incarnation, re-confirms its disk records)."""
        self.links[sid].revive(ShardActor(self.shard_config(sid)))
        return self.incarnation(sid)

    def _fresh_state(self, index: int) -> CacheState:
        n = self.config.partitions
        config = self.config.state if n == 1 else replace(self.config.state,
                                                          partition=Partition(index, n))
        return CacheState(self.spec, config)

    def restart_service(self, timeout_s: float = 60.0, partition: int | None = None) -> None:
        """A fresh metadata view (of ``partition`` only, if given); returns once every shard
        has rejoined it (or raises TimeoutError)."""
        # a crashed shard is left out: its successor registers with whichever view is there
        before = {sid: (self.incarnation(sid), self._registrations(sid))
                  for sid, link in self.links.items() if link.alive}
        for i in range(len(self.parts)) if partition is None else [partition]:
            self.parts[i].swap(self._fresh_state(i))
        self.restarts += 1
        deadline = time.monotonic() + timeout_s
        while any(self._awaited(sid, *was) for sid, was in before.items()):
            if time.monotonic() > deadline:
                raise TimeoutError("shards did not rejoin the restarted metadata view")
            time.sleep(0.05)

    def _awaited(self, sid: str, incarnation: int, registrations: int) -> bool:
        """Whether shard ``sid`` has yet to register with a restarted view (a registration
        completed since the restart began; not a rejoin begun: one in flight when the view
        swapped is refused and retried inside that same rejoin). One that crashed meanwhile
        (or was crashed and revived: a new incarnation, counting from 0) is not waited for:
        its successor registers with whichever view is there. A registration with the old
        view that lands between the snapshot and the swap counts too: the restart then
        returns before the shard rejoins, which its next heartbeat does (a miss meanwhile,
        never a wait without end)."""
        try:
            return (self.links[sid].alive and self.incarnation(sid) == incarnation
                    and self._registrations(sid) <= registrations)
        except ShardUnavailable:
            return False

    def _registrations(self, sid: str) -> int:
        stats = self.links[sid].submit("stats").result(30.0)
        return int(stats["counts"].get(REGISTRATIONS, 0))

    # -- the transition stream ------------------------------------------------------------

    def events_since(self, seq: int, limit: int = 4096) -> list[TransitionEvent]:
        if len(self.parts) > 1:
            raise NotImplementedError("the transition stream is per partition: read "
                                      "system.parts[i].events_since")
        return self.parts[0].events_since(seq, limit)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
