"""What owners report: an object's transitions, one by one or many under one lock hold.

::

    transition(object, event, params, generation)
      a reported event (not one only the core causes: LOAD_BEGIN, OFFLOAD_BEGIN)
      the live record (a lost owner's is buried when touched: Tables.live_record)
      its generation, when given (compare: stale or never issued)
      a COMPRESSED WRITE_DONE without a content version: the view issues one
      EVICT: by policy, with partners (Placement.evict); a disk event: its ticket back
      (Tables.disk_event); else Tables.apply

    transition_many(items)  -- per item: rehearsed on its record through the table and put
                               back (all or none), then reported event by event as above

A refused event raises and changes nothing (``transitions.apply``); a refused item of a
``transition_many`` is answered with its error and does not stop the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from .api import MAX_TRANSITION_ITEMS, ObjectTransitions, TransitionResult
from .errors import HkvError, IllegalTransition, InvalidInput, UnknownObject
from .ids import ObjectId
from .inputs import check_generation, check_item, check_version, params_at
from .placement import Placement
from .records import ObjRecord, set_state
from .states import TERMINAL_STATES, Event, Kind, State
from .tables import Tables
from .transitions import APPLIED_FIELDS, Params
from .transitions import apply as apply_table

__all__ = ["Reports"]

# Events on a DISK record that go through Tables.disk_event (an end of a transfer returns its
# admission ticket there)
_DISK_EVENTS = frozenset({
    Event.OFFLOAD_COMMITTED,
    Event.OFFLOAD_FAILED,
    Event.LOAD_VERIFIED,
    Event.LOAD_FAILED,
    Event.DROP_COPY,
    Event.MARK_CORRUPT,
    Event.LOSE,
})


class Reports:
    """The reported transitions of one state view; called under its lock."""

    def __init__(self, tables: Tables, placement: Placement) -> None:
        self.t = tables
        self.placement = placement

    def transition(self, object_id: ObjectId, event: Event, params: Params | None = None,
                   generation: int | None = None) -> TransitionResult:
        t = self.t
        rec = t.record(object_id)
        if generation is not None:
            check_generation(rec, generation)
        p = params or Params()
        check_version(p, object_id)
        if rec.kind is Kind.COMPRESSED and event is Event.WRITE_DONE and p.version is None:
            p = Params(t.next_version, p.lo, p.hi, p.tail_len, p.expect_seq)
        if p.version is not None:
            t.saw_version(p.version)
        if event is Event.EVICT:
            self.placement.evict(object_id)
        elif rec.kind is Kind.DISK and event in _DISK_EVENTS:
            t.disk_event(rec, p, event)
        else:
            t.apply(rec, event, p)
        return TransitionResult(rec.object_id, rec.state, rec.version, rec.seq)

    def transition_many(self, items: Sequence[ObjectTransitions]
                        ) -> list[TransitionResult | HkvError]:
        """Many objects' events under one lock acquisition: items in order, each object's
        events in order and all or none of them. Each item gives its object's result after
        its last event, or the error that refused it; a refused item changed nothing and does
        not stop the others. A malformed call (more than :data:`MAX_TRANSITION_ITEMS` items,
        an item with no events or more params than events) raises InvalidInput before
        anything is applied.

        All or none by rehearsal (:meth:`_rehearse`): an item's events first run through the
        table's ``apply`` on its record, behind the checks ``transition`` makes, and the
        record's fields are put back; only an item that passes whole is then reported, event
        by event, through ``transition``. The rehearsal is exact: from one event of an object
        to its next, nothing a precondition reads changes but the record (other objects change
        only in other items, its holds only as it ends, and an ended object takes no further
        event).
        """
        batch = [ObjectTransitions(*item) for item in items]
        if len(batch) > MAX_TRANSITION_ITEMS:
            raise InvalidInput(f"{len(batch)} items in one transition_many call; it takes at "
                               f"most {MAX_TRANSITION_ITEMS} (it holds the state's lock "
                               "throughout): split the call")
        for i, item in enumerate(batch):
            check_item(i, item)
        out: list[TransitionResult | HkvError] = []
        for item in batch:
            try:
                self._rehearse(item)
            except HkvError as err:
                out.append(err)
                continue
            for k, event in enumerate(item.events):
                result = self.transition(item.object_id, event, params_at(item, k),
                                         item.generation)
            out.append(result)
        return out

    def _rehearse(self, item: ObjectTransitions) -> None:
        """Raise what reporting ``item``'s events one by one would raise, changing nothing:
        the table's ``apply`` moves the record itself, and every field it may move is put
        back (nothing else runs meanwhile: the lock is held). An IllegalTransition says which
        event it refused (``index``)."""
        rec = self.t.record(item.object_id)
        if item.generation is not None:
            check_generation(rec, item.generation)
        saved = [getattr(rec, f) for f in APPLIED_FIELDS]
        try:
            for k, event in enumerate(item.events):
                self._rehearse_event(rec, item, k, event)
        finally:
            for f, value in zip(APPLIED_FIELDS, saved, strict=True):
                if getattr(rec, f) == value:  # (a field its kind lacks never moved)
                    continue
                if f == "state":  # its class's (records.set_state)
                    set_state(rec, value)
                else:
                    setattr(rec, f, value)

    def _rehearse_event(self, rec: ObjRecord, item: ObjectTransitions, k: int,
                        event: Event) -> None:
        if rec.state in TERMINAL_STATES:  # ended by event k - 1: transition would not find it
            raise UnknownObject(f"object {rec.object_id} is gone after event {k - 1} of its "
                                f"item ({item.events[k - 1].value})" if k else
                                f"object {rec.object_id} is gone")
        p = params_at(item, k) or Params()
        check_version(p, rec.object_id)
        if event is Event.EVICT:  # as evict() applies it
            drop = rec.kind is Kind.DISK and rec.state is State.ON_DISK_READY
            event, p = (Event.DROP_COPY if drop else Event.EVICT), Params()
        try:
            apply_table(rec, event, p, self.t)
        except IllegalTransition as err:
            err.index = k
            raise

