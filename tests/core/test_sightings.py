"""Save admission (core/sightings.py): a chain's blocks are admitted once offered ``needed``
times; what is admitted is always a prefix; bad input records nothing."""

from __future__ import annotations

import pytest

from hkv_service.core.errors import BadHash, InvalidInput
from hkv_service.core.ids import BlockHash
from hkv_service.core.sightings import MAX_NEEDED, Sightings
from hkv_service.core.state_view import CacheState
from hkv_service.specs import default_spec


def chain(tag: bytes, n: int) -> list[BlockHash]:
    import xxhash
    return [BlockHash(xxhash.xxh3_128_digest(tag + b"/%d" % i)) for i in range(n)]


def test_a_chain_is_admitted_on_its_second_offer() -> None:
    s = Sightings()
    doc = chain(b"doc", 8)
    assert s.admit(doc, 2) == 0  # first sight: nothing saved
    assert s.admit(doc, 2) == 8
    assert s.admit(doc, 3) == 8  # a third offer reaches 3
    assert s.admit(chain(b"other", 8), 1) == 8  # needed 1: always whole


def test_what_is_admitted_is_the_prefix_seen_before() -> None:
    s = Sightings()
    doc = chain(b"doc", 8)
    s.admit(doc, 2)
    turn2 = doc + chain(b"turn2", 4)  # the same document, a new question after it
    assert s.admit(turn2, 2) == 8
    assert s.admit(turn2, 2) == 12
    # a block seen twice after one that was not is not admitted: no hit could reach it
    fresh = chain(b"fresh", 2) + doc
    assert s.admit(fresh, 2) == 0


def test_a_request_offers_each_block_once_as_its_saves_come() -> None:
    s = Sightings()
    doc = chain(b"doc", 8)
    assert s.admit(doc[:3], 2) == 0  # a request's first step saves 3 blocks
    assert s.admit(doc, 2, offered_from=3) == 3  # its next step the rest: still one offer
    assert s.admit(doc, 2) == 8  # a second request
    # a request that hit the first 5 blocks offers the rest only; the hits are not looked at
    # (a restarted service counts nothing, yet holds them: a save past them still lands)
    s2 = Sightings()
    assert s2.admit(doc, 2, offered_from=5) == 5
    assert s2.admit(doc, 2, offered_from=5) == 8


def test_bad_input_records_nothing() -> None:
    s = Sightings()
    doc = chain(b"doc", 4)
    for needed in (0, MAX_NEEDED + 1):
        with pytest.raises(InvalidInput):
            s.admit(doc, needed)
    with pytest.raises(InvalidInput):
        s.admit(doc, 2, offered_from=5)
    with pytest.raises(BadHash):
        s.admit([*doc, BlockHash(b"short")], 2)
    assert s.admit(doc, 2) == 0  # none of the refused calls counted an offer


def test_colliding_hashes_take_their_slot_in_turn() -> None:
    s = Sightings(slots=1)  # every hash in one slot
    a, b = chain(b"a", 1), chain(b"b", 1)
    assert s.admit(a, 2) == 0
    assert s.admit(b, 2) == 0  # b took the slot
    assert s.admit(a, 2) == 0  # a is a first sight again: one save later, never wrong bytes
    assert s.admit(a, 2) == 1


def test_the_state_view_answers_it_under_its_lock() -> None:
    state = CacheState(default_spec())
    doc = chain(b"doc", 3)
    assert state.admit_save(doc, 2) == 0
    assert state.admit_save(doc, 2) == 3
    assert state.object_count() == 0  # advice only: no entry, no object
