"""Reporting commits to the metadata service: one home for the rules both writers follow (the
shard, committing what it wrote itself, and the data plane, committing a whole request's
writes across shards in one call).

A commit is a short list of events for one object, all or none (``transition_many``). A call
may be sent again after a timeout or a restart, so an event refused *only* because its object
already is in a state the event leads to counts as done (:func:`already_done`): that item is
reported again without it. Nothing is remembered across calls: the same event legitimately
repeats on one object (a disk copy loaded again, an indexer re-synced).
"""

from __future__ import annotations

from collections.abc import Sequence

from hkv_service.core.api import Handle, ObjectTransitions, Params, TransitionResult
from hkv_service.core.contracts import CONTRACTS
from hkv_service.core.errors import (
    AdmissionRefused,
    FailedPrecondition,
    HkvError,
    IllegalTransition,
    NotFound,
    ResourceExhausted,
    StaleHandle,
)
from hkv_service.core.ids import ObjectId
from hkv_service.core.port import MetadataPort
from hkv_service.core.states import Event, Kind, State
from storage import DiskFull, NotOnDisk

from .ports import Commit, ItemResult, Outcome

__all__ = ["COMMIT_CHUNK", "already_done", "commit_many", "commit_one", "failure", "refused"]

# Commits reported in one transition_many call: the service holds its lock for a whole call,
# so a write of thousands of objects goes in calls this size (a 16-block prefix in one).
COMMIT_CHUNK = 512

_READY = {k: c.ready_state for k, c in CONTRACTS.items()}
# What a repeat of each event finds its object in: the state the event leads to, or one it
# moves on to by itself (an indexer written is synced; a disk copy committed is loaded)
_TARGET = {
    Event.WRITE_DONE: {_READY[Kind.COMPRESSED], _READY[Kind.SWA], State.INDEXER_WRITTEN,
                       _READY[Kind.INDEXER], _READY[Kind.STATE]},
    Event.TAIL_DONE: {_READY[Kind.TAIL]},
    Event.INDEXER_SYNC: {_READY[Kind.INDEXER]},
    Event.OFFLOAD_COMMITTED: {State.ON_DISK, State.ON_DISK_INFLIGHT, _READY[Kind.DISK]},
    Event.LOAD_VERIFIED: {_READY[Kind.DISK]},
}


def commit_many(meta: MetadataPort, items: Sequence[tuple[Handle, Commit]]
                ) -> list[ItemResult]:
    """Report every item's commit, in order, :data:`COMMIT_CHUNK` items a ``transition_many``
    call; an item's result carries the version its object ends with. A call that fails
    fails every item of it (it raises nothing)."""
    return [r for first in range(0, len(items), COMMIT_CHUNK)
            for r in _commit_chunk(meta, items[first : first + COMMIT_CHUNK])]


def _commit_chunk(meta: MetadataPort, items: Sequence[tuple[Handle, Commit]]
                  ) -> list[ItemResult]:
    out: list[ItemResult | None] = [None] * len(items)
    todo = {i: ObjectTransitions(h.object_id, c.events,
                                 [c.params_at(k) for k in range(len(c.events))],
                                 h.generation) for i, (h, c) in enumerate(items)}
    while todo:
        try:
            replies = meta.transition_many(list(todo.values()))
        except Exception as exc:  # the call itself failed: every item with it
            return [r or failure(exc) for r in out]
        again = {}
        for (i, item), reply in zip(todo.items(), replies, strict=True):
            if isinstance(reply, TransitionResult):
                out[i] = ItemResult(Outcome.OK, version=reply.version)
            elif isinstance(reply, IllegalTransition) and reply.index is not None and \
                    already_done(reply, item.events[reply.index]):
                rest = _without(item, reply.index)
                if rest.events:  # its other events were not applied (all or none): again
                    again[i] = rest
                else:
                    out[i] = ItemResult(Outcome.OK, "already in the target state")
            else:
                out[i] = refused(reply)
        todo = again
    return [r or ItemResult(Outcome.FAILED, "not reported") for r in out]


def commit_one(meta: MetadataPort, oid: ObjectId, event: Event, params: Params | None = None,
               generation: int | None = None) -> ItemResult:
    """Report one transition; a repeat of one already applied is OK (see the module)."""
    try:
        res = meta.transition(oid, event, params, generation)
    except IllegalTransition as exc:
        if already_done(exc, event):
            return ItemResult(Outcome.OK, "already in the target state")
        return refused(exc)
    except Exception as exc:
        return failure(exc)
    return ItemResult(Outcome.OK, version=res.version)


def already_done(exc: IllegalTransition, event: Event) -> bool:
    """``event`` was refused because its object already is in a state it leads to: the table
    has no such move from there (no precondition refused it)."""
    return exc.precondition is None and exc.state in _TARGET.get(event, ())


def refused(err: HkvError) -> ItemResult:
    """A refused report: an illegal move reads NOT_READABLE with its sentence."""
    if isinstance(err, IllegalTransition):
        return ItemResult(Outcome.NOT_READABLE, str(err))
    return failure(err)


def _without(item: ObjectTransitions, k: int) -> ObjectTransitions:
    """``item`` less its event ``k`` (and that event's params)."""
    params = list(item.params) + [None] * (len(item.events) - len(item.params))
    return item._replace(events=[*item.events[:k], *item.events[k + 1:]],
                         params=params[:k] + params[k + 1:])


def failure(exc: BaseException) -> ItemResult:
    """One place mapping what a metadata or disk call raised to an item outcome."""
    outcome = next((o for kind, o in _OUTCOME_OF if isinstance(exc, kind)), Outcome.FAILED)
    return ItemResult(outcome, f"{type(exc).__name__}: {exc}", cause=type(exc))


_OUTCOME_OF: tuple[tuple[type[BaseException], Outcome], ...] = (  # first match wins
    (AdmissionRefused, Outcome.ADMISSION),
    (DiskFull, Outcome.DISK_FULL),
    (NotOnDisk, Outcome.MISSING),
    (StaleHandle, Outcome.STALE),
    (NotFound, Outcome.LOST),
    (FailedPrecondition, Outcome.NOT_READABLE),
    (ResourceExhausted, Outcome.ADMISSION),
)
