"""hkv's Ray edge for the workers: a shard link over an actor handle, and a ``CacheState`` in
a Ray actor.

* :class:`RayLink` is the :class:`~workers.link.ShardLink` over a ``ShardActor`` Ray actor:
  ``submit`` is ``actor.method.remote(...)``, ``result`` is ``ray.get`` with the deadline; a dead
  or silent actor is :class:`~workers.link.ShardUnavailable` (its call is cancelled). Ray copies
  every argument and result, which the read path relies on (see :mod:`workers.link`).
* :data:`MetadataActor` holds a ``CacheState`` in a Ray actor; :class:`ActorMetadata` is the
  port adapter other processes (shards, Ray tasks) use to reach it. Errors keep their hkv
  type: Ray re-raises an actor's exception as a subclass of the original class.

Only this module and the launcher import Ray among ``workers``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from hkv_service.core.allocator import PoolConfig
from hkv_service.core.errors import HkvError
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
    ObjectTransitions,
    StateConfig,
    TransitionResult,
)
from hkv_service.core.states import Event
from hkv_service.core.transitions import Params

from .link import ShardUnavailable
from .local import LocalMetadata

__all__ = ["ActorMetadata", "MetadataActor", "RayLink", "ray_links", "shard_actors"]

_UNAVAILABLE = (RayActorError, GetTimeoutError)  # ActorDiedError/ActorUnavailableError inside


class _RayPending:
    def __init__(self, shard: str, ref: Any) -> None:
        self.shard, self.ref = shard, ref

    def result(self, timeout_s: float) -> Any:
        try:
            return ray.get(self.ref, timeout=timeout_s)
        except _UNAVAILABLE as exc:
            # already finished or the actor is gone: nothing to cancel
            with contextlib.suppress(Exception):
                ray.cancel(self.ref, force=True)
            raise ShardUnavailable(self.shard, type(exc).__name__) from exc


class RayLink:
    """The link to a ``ShardActor`` Ray actor."""

    def __init__(self, shard_id: str, actor: Any) -> None:
        self.shard_id = shard_id
        self.actor = actor

    def submit(self, method: str, *args: Any, **kwargs: Any) -> _RayPending:
        return _RayPending(self.shard_id, getattr(self.actor, method).remote(*args, **kwargs))


NAMESPACE = "hkv"  # the Ray namespace hkv up places its actors in
SHARD_PREFIX = "shard-"  # the names the launcher gives shard actors


def shard_actors(namespace: str, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The shard actors ``hkv up`` placed in ``namespace`` (all of them, or ``names``)."""
    if names is None:
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a.get("namespace") == namespace and a["name"].startswith(SHARD_PREFIX))
    return {n: ray.get_actor(n, namespace=namespace) for n in names}


def ray_links(actors: Mapping[str, Any]) -> dict[str, RayLink]:
    """One :class:`RayLink` per shard actor handle."""
    return {sid: RayLink(sid, actor) for sid, actor in actors.items()}


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

    def mark_owner_lost(self, owner: ShardId, witnesses: Sequence[int] = ()
                        ) -> int | None:
        return self._call("mark_owner_lost", owner, list(witnesses))  # type: ignore[no-any-return]

    def confirm(self, owner: ShardId, reports: Sequence[ObjectReport], incarnation: int) -> int:
        return int(self._call("confirm", owner, list(reports), incarnation))

    def confirm_objects(self, owner: ShardId, reports: Sequence[ObjectReport], incarnation: int
                        ) -> list[ObjectId | None]:
        return self._call("confirm_objects", owner, list(reports), incarnation)  # type: ignore[no-any-return]

    def allocate(
        self,
        block_hashes: Sequence[BlockHash],
        requests: Sequence[AllocRequest],
        owner: ShardId | None = None,
        first_block: int = 0,
    ) -> list[Allocation]:
        return self._call("allocate", list(block_hashes), list(requests), owner,  # type: ignore[no-any-return]
                          first_block)

    def transition(
        self,
        object_id: ObjectId,
        event: Event,
        params: Params | None = None,
        generation: int | None = None,
    ) -> TransitionResult:
        return self._call("transition", object_id, event, params, generation)  # type: ignore[no-any-return]

    def transition_many(self, items: Sequence[ObjectTransitions]
                        ) -> list[TransitionResult | HkvError]:
        # one actor call; a refused item's error comes back as a value (pickled whole, fields
        # and all), not raised
        return self._call("transition_many", [ObjectTransitions(*it) for it in items])  # type: ignore[no-any-return]

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


