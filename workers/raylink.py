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
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from hkv_service.core import api
from hkv_service.core.errors import HkvError
from hkv_service.core.ids import BlockHash, LeaseId, ObjectId, ShardId
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event

from .link import ShardUnavailable
from .local import LocalMetadata

__all__ = ["ActorMetadata", "MetadataActor", "RayLink", "ray_links", "shard_actors"]

log = logging.getLogger(__name__)

_UNAVAILABLE = (RayActorError, GetTimeoutError)  # ActorDiedError/ActorUnavailableError inside
RESOLVE_EVERY_S = 1.0  # a link whose actor died for good looks its name up again at most this often


class _RayPending:
    def __init__(self, link: RayLink, ref: Any, instance: int) -> None:
        self.link, self.ref, self.instance = link, ref, instance

    def result(self, timeout_s: float) -> Any:
        try:
            return ray.get(self.ref, timeout=timeout_s)
        except _UNAVAILABLE as exc:
            # already finished or the actor is gone: nothing to cancel
            with contextlib.suppress(Exception):
                ray.cancel(self.ref, force=True)
            self.link.failed(isinstance(exc, ActorDiedError))
            raise ShardUnavailable(self.link.shard_id, type(exc).__name__,
                                   self.instance) from exc


class _Failed:
    """A call that could not even be sent (no live actor under the shard's name)."""

    def __init__(self, error: ShardUnavailable) -> None:
        self.error = error

    def result(self, timeout_s: float) -> Any:
        raise self.error


class RayLink:
    """The link to a ``ShardActor`` Ray actor.

    It knows the shard process it talks to (``ShardActor.instance``, from a ``ping`` sent
    ahead of the first call and again after every failure), so a failed call reports the
    loss of that process and never of a successor. When the actor dies for good (its
    restarts used up) the link looks its name up again in ``namespace``: ``hkv up`` places
    a new actor under the same name, and calls go to it from then on (without this, a worker
    attached before the replacement failed every call, and reported the new shard lost with
    every failure, for as long as it ran)."""

    def __init__(self, shard_id: str, actor: Any, namespace: str | None = None) -> None:
        self.shard_id = shard_id
        self.actor = actor
        self.namespace = namespace
        self._lock = threading.Lock()
        self._instance = 0
        self._probe: Any = None  # a ping in flight: its answer names the process
        self._dead = False  # the actor died for good: look the name up again
        self._resolved_at = 0.0
        self._send_probe()

    def submit(self, method: str, *args: Any, **kwargs: Any) -> _RayPending | _Failed:
        if self._dead and not self._resolve():
            return _Failed(ShardUnavailable(self.shard_id, "the shard actor died and no new "
                                            "one is placed under its name yet"))
        instance = self.instance()
        if not instance and self._probe is None:
            self._send_probe()
        return _RayPending(self, getattr(self.actor, method).remote(*args, **kwargs), instance)

    def instance(self) -> int:
        """The shard process this link's calls go to, if known (0: not yet)."""
        with self._lock:
            probe = self._probe
        if probe is not None and not self._instance:
            ready, _ = ray.wait([probe], timeout=0)
            if ready:
                try:
                    got = int(ray.get(probe).get("instance", 0))
                except Exception:  # the process died before answering: still unknown
                    got = 0
                with self._lock:
                    if self._probe is probe:
                        self._instance, self._probe = got, None
        return self._instance

    def failed(self, died_for_good: bool) -> None:
        """A call failed: the process it went to is gone (or silent); the next one is
        another, to be learnt again. ``died_for_good``: no restart is coming under this
        handle."""
        with self._lock:
            self._instance, self._probe = 0, None
            self._dead = self._dead or (died_for_good and self.namespace is not None)

    def _send_probe(self) -> None:
        with self._lock:
            try:
                self._probe = self.actor.ping.remote()
            except Exception:  # the handle is unusable: learnt after the next resolve
                self._probe = None

    def _resolve(self) -> bool:
        """Look the shard's name up again (at most every RESOLVE_EVERY_S); True if a live
        actor other than the dead one is there now."""
        now = time.monotonic()
        if now - self._resolved_at < RESOLVE_EVERY_S:
            return False
        self._resolved_at = now
        try:
            actor = ray.get_actor(self.shard_id, namespace=self.namespace)
        except Exception:  # not placed (yet), or Ray unreachable
            return False
        if actor._actor_id == self.actor._actor_id:
            return False  # the same dead actor: its name is still registered
        with self._lock:
            self.actor, self._dead, self._instance = actor, False, 0
        self._send_probe()
        log.info("shard %s: calls go to its new actor from now on", self.shard_id)
        return True


NAMESPACE = "hkv"  # the Ray namespace hkv up places its actors in
SHARD_PREFIX = "shard-"  # the names the launcher gives shard actors


def shard_actors(namespace: str, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The shard actors ``hkv up`` placed in ``namespace`` (all of them, or ``names``)."""
    if names is None:
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a.get("namespace") == namespace and a["name"].startswith(SHARD_PREFIX))
    return {n: ray.get_actor(n, namespace=namespace) for n in names}


def ray_links(actors: Mapping[str, Any], namespace: str | None = NAMESPACE
              ) -> dict[str, RayLink]:
    """One :class:`RayLink` per shard actor handle (named in ``namespace``: a link whose actor
    died for good finds the one placed under its name next; None: it does not look)."""
    return {sid: RayLink(sid, actor, namespace) for sid, actor in actors.items()}


class _StateHolder(LocalMetadata):
    """Body of :class:`MetadataActor`: a ``CacheState`` built inside the actor."""

    def __init__(self, spec: CacheSpec, config: api.StateConfig | None = None) -> None:
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

    def register_owner(self, owner: ShardId, pools: Mapping[str, api.PoolConfig],
                       instance: int = 0) -> int:
        return int(self._call("register_owner", owner, dict(pools), instance))

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        self._call("heartbeat", owner, incarnation)

    def mark_owner_lost(self, owner: ShardId, witnesses: Sequence[int] = (),
                        instance: int = 0) -> int | None:
        return self._call("mark_owner_lost", owner, list(witnesses), instance)  # type: ignore[no-any-return]

    def confirm(self, owner: ShardId, reports: Sequence[api.ObjectReport], incarnation: int) -> int:
        return int(self._call("confirm", owner, list(reports), incarnation))

    def confirm_objects(self, owner: ShardId, reports: Sequence[api.ObjectReport], incarnation: int
                        ) -> list[ObjectId | None]:
        return self._call("confirm_objects", owner, list(reports), incarnation)  # type: ignore[no-any-return]

    def allocate(self, block_hashes: Sequence[BlockHash], requests: Sequence[api.AllocRequest],
                 owner: ShardId | None = None, first_block: int = 0,
                 token_ids: Sequence[int] | None = None) -> list[api.Allocation]:
        # an actor's state publishes no KV events: its token_ids are not sent
        return self._call("allocate", list(block_hashes), list(requests), owner,  # type: ignore[no-any-return]
                          first_block)

    def transition(self, object_id: ObjectId, event: Event, params: api.Params | None = None,
                   generation: int | None = None) -> api.TransitionResult:
        return self._call("transition", object_id, event, params, generation)  # type: ignore[no-any-return]

    def transition_many(self, items: Sequence[api.ObjectTransitions]
                        ) -> list[api.TransitionResult | HkvError]:
        # one actor call; a refused item's error comes back as a value (pickled whole, fields
        # and all), not raised
        return self._call("transition_many", [api.ObjectTransitions(*it) for it in items])  # type: ignore[no-any-return]

    def evict(self, object_id: ObjectId) -> None:
        self._call("evict", object_id)

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> api.Handle:
        return self._call("begin_offload", object_id, disk_owner)  # type: ignore[no-any-return]

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> api.Handle:
        return self._call("begin_load", object_id, owner)  # type: ignore[no-any-return]

    def lookup(self, req: api.LookupRequest) -> api.Match:
        return self._call("lookup", req)  # type: ignore[no-any-return]

    def admit_save(self, block_hashes: Sequence[BlockHash], needed: int,
                   offered_from: int = 0) -> int:
        return int(self._call("admit_save", list(block_hashes), needed, offered_from))

    def release_lease(self, lease_id: LeaseId) -> None:
        self._call("release_lease", lease_id)

    def check_read(self, handle: api.Handle, lease_id: LeaseId | None = None) -> None:
        self._call("check_read", handle, lease_id)

    def expire_owners(self) -> list[ShardId]:
        return self._call("expire_owners")  # type: ignore[no-any-return]

    def stats(self) -> dict[str, object]:
        return self._call("stats")  # type: ignore[no-any-return]


