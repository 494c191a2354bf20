"""Metadata without gRPC: the port over a ``CacheState`` in this process.

* :class:`LocalMetadata` calls a ``CacheState`` in the same process (the in-process wiring,
  unit tests, benches). ``swap`` puts a fresh state behind it: a service restart.
* :func:`connect` turns what a shard is given (an endpoint string or a port) into a
  :class:`~hkv_service.core.port.MetadataPort`. The Ray actor holding a state is in
  :mod:`workers.raylink` (this module imports no Ray).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hkv_service.core import api
from hkv_service.core.errors import HkvError
from hkv_service.core.ids import BlockHash, LeaseId, ObjectId, ShardId
from hkv_service.core.port import MetadataPort
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event
from hkv_service.settings import TlsConfig

from .partitioned import PartitionedMetadata

__all__ = ["LocalMetadata", "connect"]


class LocalMetadata:
    """The port over a ``CacheState`` in this process (one call = one method call)."""

    def __init__(self, state: CacheState) -> None:
        self.state = state

    def get_spec(self) -> CacheSpec:
        return self.state.spec

    def register_owner(self, owner: ShardId, pools: Mapping[str, api.PoolConfig],
                       instance: int = 0) -> int:
        incarnation = self.state.register_owner(owner, pools, instance)
        self.state.reap_all()  # a known owner coming back lost its old incarnation
        return incarnation

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        self.state.heartbeat(owner, incarnation)

    def mark_owner_lost(self, owner: ShardId, witnesses: Sequence[int] = (),
                        instance: int = 0) -> int | None:
        lost = self.state.mark_owner_lost(owner, witnesses, instance)
        self.state.reap_all()  # in process there is no reaper thread: slices, here and now
        return lost

    def confirm(self, owner: ShardId, reports: Sequence[api.ObjectReport], incarnation: int) -> int:
        confirmed = self.state.confirm(owner, reports, incarnation)
        self.state.reap_all()  # the orphans it left to adopt in slices: no reaper thread here
        return confirmed

    def confirm_objects(self, owner: ShardId, reports: Sequence[api.ObjectReport], incarnation: int
                        ) -> list[ObjectId | None]:
        ids = self.state.confirm_objects(owner, reports, incarnation)
        self.state.reap_all()  # the orphans it left to adopt in slices: no reaper thread here
        return ids

    def allocate(self, block_hashes: Sequence[BlockHash], requests: Sequence[api.AllocRequest],
                 owner: ShardId | None = None, first_block: int = 0,
                 token_ids: Sequence[int] | None = None) -> list[api.Allocation]:
        # token_ids are for the KV event stream, which only a served state publishes
        return self.state.allocate(block_hashes, requests, owner, first_block)

    def transition(self, object_id: ObjectId, event: Event, params: api.Params | None = None,
                   generation: int | None = None) -> api.TransitionResult:
        return self.state.transition(object_id, event, params, generation)

    def transition_many(self, items: Sequence[api.ObjectTransitions]
                        ) -> list[api.TransitionResult | HkvError]:
        return self.state.transition_many(items)

    def evict(self, object_id: ObjectId) -> None:
        self.state.evict(object_id)

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> api.Handle:
        return self.state.begin_offload(object_id, disk_owner)

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> api.Handle:
        return self.state.begin_load(object_id, owner)

    def lookup(self, req: api.LookupRequest) -> api.Match:
        return self.state.lookup(req)  # its handle columns are a snapshot taken atomically

    def admit_save(self, block_hashes: Sequence[BlockHash], needed: int,
                   offered_from: int = 0) -> int:
        return self.state.admit_save(block_hashes, needed, offered_from)

    def release_lease(self, lease_id: LeaseId) -> None:
        self.state.release_lease(lease_id)

    def check_read(self, handle: api.Handle, lease_id: LeaseId | None = None) -> None:
        self.state.check_read(handle, lease_id)

    # not part of the port
    def swap(self, state: CacheState) -> CacheState:
        """Put ``state`` behind this port (a service restart); returns the old one."""
        old, self.state = self.state, state
        return old

    def events_since(self, seq: int, limit: int = 1024) -> list[api.TransitionEvent]:
        return self.state.events_since(seq, limit)

    def expire_owners(self) -> list[ShardId]:
        expired = self.state.expire_owners()
        self.state.reap_all()
        return expired

    def stats(self) -> dict[str, object]:
        return self.state.stats()


def connect(source: Any, token: str | None = None, timeout_s: float = 10.0,
            tls: TlsConfig | None = None) -> MetadataPort:
    """A port from an endpoint ``"host:port"`` (gRPC; ``token`` and ``tls`` as the service
    wants them), a port (e.g. ``LocalMetadata``, ``workers.raylink.ActorMetadata``), or
    several of either (``"host:p0,host:p1"`` or a list, in partition order: a
    :class:`~workers.partitioned.PartitionedMetadata` over the service's partitions)."""
    if isinstance(source, str) and "," in source:
        source = [e.strip() for e in source.split(",") if e.strip()]
    if isinstance(source, list | tuple):
        parts = [connect(s, token, timeout_s, tls) for s in source]
        return parts[0] if len(parts) == 1 else PartitionedMetadata(parts)
    if isinstance(source, str):
        from hkv_service.client import MetadataClient  # the gRPC client (server/ + client/)

        return MetadataClient(source, token=token, tls=tls, timeout_s=timeout_s)
    if type(source).__module__.startswith("ray."):  # a bare actor handle fakes every method
        raise TypeError("a Ray actor handle is not a metadata port: wrap a MetadataActor handle "
                        "in workers.raylink.ActorMetadata")
    if isinstance(source, MetadataPort):
        return source
    raise TypeError(f"cannot reach the metadata service through a {type(source).__name__}")
