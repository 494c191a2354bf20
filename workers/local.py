"""Metadata without gRPC: an in-process adapter and a Ray actor around one ``CacheState``.

* :class:`LocalMetadata` calls a ``CacheState`` in the same process (unit tests, benches).
* :class:`MetadataActor` holds a ``CacheState`` in a Ray actor; :class:`ActorMetadata` is the
  port adapter other processes (shards, Ray tasks) use to reach it. Errors keep their hkv
  type: Ray re-raises an actor's exception as a subclass of the original class.
* :func:`connect` turns what a shard is given (an endpoint string, an actor handle or a port)
  into a :class:`~workers.ports.MetadataPort`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray

from hkv_service.core.allocator import PoolConfig
from hkv_service.core.funnel import LookupRequest
from hkv_service.core.ids import BlockHash, LeaseId, ObjectId, ShardId
from hkv_service.core.records import Handle
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import (
    Allocation,
    AllocRequest,
    CacheState,
    Match,
    ObjectReport,
    StateConfig,
    TransitionResult,
)
from hkv_service.core.states import Event
from hkv_service.core.transitions import Params

from .ports import MetadataPort

__all__ = ["ActorMetadata", "LocalMetadata", "MetadataActor", "connect"]


class LocalMetadata:
    """The port over a ``CacheState`` in this process (one call = one method call)."""

    def __init__(self, state: CacheState) -> None:
        self.state = state

    def get_spec(self) -> CacheSpec:
        return self.state.spec

    def register_owner(self, owner: ShardId, pools: Mapping[str, PoolConfig]) -> int:
        return self.state.register_owner(owner, pools)

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        self.state.heartbeat(owner, incarnation)

    def mark_owner_lost(self, owner: ShardId) -> int:
        return self.state.mark_owner_lost(owner)

    def confirm(self, owner: ShardId, reports: Sequence[ObjectReport], incarnation: int) -> int:
        return self.state.confirm(owner, reports, incarnation)

    def allocate(
        self,
        block_hashes: Sequence[BlockHash],
        requests: Sequence[AllocRequest],
        owner: ShardId | None = None,
    ) -> list[Allocation]:
        return self.state.allocate(block_hashes, requests, owner)

    def transition(
        self,
        object_id: ObjectId,
        event: Event,
        params: Params | None = None,
        generation: int | None = None,
    ) -> TransitionResult:
        return self.state.transition(object_id, event, params, generation)

    def evict(self, object_id: ObjectId) -> None:
        self.state.evict(object_id)

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> Handle:
        return self.state.begin_offload(object_id, disk_owner)

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> Handle:
        return self.state.begin_load(object_id, owner)

    def lookup(self, req: LookupRequest) -> Match:
        return self.state.lookup(req)  # its handle columns are a snapshot taken atomically

    def release_lease(self, lease_id: LeaseId) -> None:
        self.state.release_lease(lease_id)

    def check_read(self, handle: Handle, lease_id: LeaseId | None = None) -> None:
        self.state.check_read(handle, lease_id)

    # test helpers (not part of the port)
    def expire_owners(self) -> list[ShardId]:
        return self.state.expire_owners()

    def stats(self) -> dict[str, object]:
        return self.state.stats()


class _StateHolder(LocalMetadata):
    """Body of :class:`MetadataActor`: a ``CacheState`` built inside the actor."""

    def __init__(self, spec: CacheSpec, config: StateConfig | None = None) -> None:
        super().__init__(CacheState(spec, config))

    def call(self, method: str, *args: Any) -> Any:
        # Results pickle as they are: a Match holds a snapshot of plain tuples.
        return getattr(self, method)(*args)


MetadataActor = ray.remote(num_cpus=0)(_StateHolder)


class ActorMetadata:
    """The port over a :data:`MetadataActor` handle; every call waits at most ``timeout_s``."""

    def __init__(self, actor: Any, timeout_s: float = 10.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        return ray.get(self.actor.call.remote(method, *args), timeout=self.timeout_s)

    def get_spec(self) -> CacheSpec:
        return self._call("get_spec")  # type: ignore[no-any-return]

    def register_owner(self, owner: ShardId, pools: Mapping[str, PoolConfig]) -> int:
        return int(self._call("register_owner", owner, dict(pools)))

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        self._call("heartbeat", owner, incarnation)

    def mark_owner_lost(self, owner: ShardId) -> int:
        return int(self._call("mark_owner_lost", owner))

    def confirm(self, owner: ShardId, reports: Sequence[ObjectReport], incarnation: int) -> int:
        return int(self._call("confirm", owner, list(reports), incarnation))

    def allocate(
        self,
        block_hashes: Sequence[BlockHash],
        requests: Sequence[AllocRequest],
        owner: ShardId | None = None,
    ) -> list[Allocation]:
        return self._call("allocate", list(block_hashes), list(requests), owner)  # type: ignore[no-any-return]

    def transition(
        self,
        object_id: ObjectId,
        event: Event,
        params: Params | None = None,
        generation: int | None = None,
    ) -> TransitionResult:
        return self._call("transition", object_id, event, params, generation)  # type: ignore[no-any-return]

    def evict(self, object_id: ObjectId) -> None:
        self._call("evict", object_id)

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> Handle:
        return self._call("begin_offload", object_id, disk_owner)  # type: ignore[no-any-return]

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> Handle:
        return self._call("begin_load", object_id, owner)  # type: ignore[no-any-return]

    def lookup(self, req: LookupRequest) -> Match:
        return self._call("lookup", req)  # type: ignore[no-any-return]

    def release_lease(self, lease_id: LeaseId) -> None:
        self._call("release_lease", lease_id)

    def check_read(self, handle: Handle, lease_id: LeaseId | None = None) -> None:
        self._call("check_read", handle, lease_id)

    def expire_owners(self) -> list[ShardId]:
        return self._call("expire_owners")  # type: ignore[no-any-return]

    def stats(self) -> dict[str, object]:
        return self._call("stats")  # type: ignore[no-any-return]


def connect(source: Any, token: str | None = None, timeout_s: float = 10.0) -> MetadataPort:
    """A port from an endpoint ``"host:port"`` (gRPC), a MetadataActor handle, or a port."""
    if isinstance(source, str):
        from hkv_service.client import MetadataClient  # the gRPC client (server/ + client/)

        return MetadataClient(source, token=token, timeout_s=timeout_s)
    if isinstance(source, ray.actor.ActorHandle):
        return ActorMetadata(source, timeout_s)
    if isinstance(source, MetadataPort):
        return source
    raise TypeError(f"cannot reach the metadata service through a {type(source).__name__}")
