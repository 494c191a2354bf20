"""The index in parts: a dict to every caller, and no part near the size of the whole."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash
from hkv_service.core.prefix_index import PARTS, Orphans, PrefixIndex
from hkv_service.core.records import PrefixEntry

KEYS = [BlockHash(bytes([i % 4]) + bytes(14) + bytes([i])) for i in range(24)]
OPS = st.lists(st.tuples(st.sampled_from(["set", "del", "get"]), st.sampled_from(KEYS)),
               max_size=60)


def _entry(h: BlockHash) -> PrefixEntry:
    return PrefixEntry(h, None, 0, [])


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_it_answers_as_one_dict(ops: list[tuple[str, BlockHash]]) -> None:
    index, model = PrefixIndex(), {}
    for op, h in ops:
        if op == "set":
            index[h] = model[h] = _entry(h)
        elif op == "del" and h in model:
            del index[h], model[h]
        assert index.get(h) is model.get(h) and (h in index) == (h in model)
    assert len(index) == len(model) and bool(index) == bool(model)
    # the rule the walk and the re-confirm inline: hash h lives in parts[h[0]], and only there
    assert all(index.parts[h[0]].get(h) is e for h, e in model.items())
    assert sum(map(len, index.parts)) == len(model)
    assert dict(index.items()) == model and set(index) == set(model) == set(index.keys())
    assert sorted(map(id, index.values())) == sorted(map(id, model.values()))


def test_what_is_not_a_block_hash_is_in_no_part() -> None:
    index = PrefixIndex()
    index[KEYS[0]] = _entry(KEYS[0])
    for bad in (b"", "a string", 7, None, (1, 2)):
        assert index.get(bad) is None and bad not in index  # (no exception: a miss)


def test_no_part_holds_much_more_than_its_share() -> None:
    """The bound the parts exist for: the dict a resize copies holds ~1/PARTS of the entries
    (xxh3 block hashes: their first byte is uniform)."""
    n = 100_000
    tokens = np.random.default_rng(0).integers(0, 50_000, n * 4)
    index = PrefixIndex()
    for h in hash_blocks(tokens, 4, ExtraKeys("m")):
        index[h] = _entry(h)
    assert len(index) == n
    assert index.largest_part() < 1.5 * n / PARTS  # (a flat dict: n)


def test_orphans_wait_for_the_first_parent_named_until_taken_or_forgotten() -> None:
    book = Orphans()
    a, b, c = (_entry(k) for k in KEYS[:3])
    book.wait(a, KEYS[5])
    book.wait(b, KEYS[5])
    book.wait(c, KEYS[6])
    book.wait(a, KEYS[7])  # named again under another hash: the first stays
    assert a.awaits == KEYS[5] and c.awaits == KEYS[6] and len(book) == 3
    book.forget(b)
    assert b.awaits is None and len(book) == 2
    assert book.take(KEYS[5], 4) == (a,) and a.awaits is None
    assert book.take(KEYS[5], 4) == () and book.take(KEYS[7], 4) == ()
    book.forget(c)
    book.forget(c)  # (twice: nothing)
    assert not book and book.take(KEYS[6], 4) == ()
    d, e = _entry(KEYS[8]), _entry(KEYS[9])  # siblings: the last one forgotten empties it
    book.wait(d, KEYS[5])
    book.wait(e, KEYS[5])
    book.forget(d)
    book.forget(e)
    assert not book


def test_orphans_are_taken_a_slice_at_a_time_first_come_first() -> None:
    """``take`` hands out at most its limit, those that waited longest first; the rest wait on
    (``waits_for``), each exactly once, and one forgotten meanwhile is never handed out."""
    book = Orphans()
    kids = [_entry(k) for k in KEYS[:7]]
    for kid in kids:
        book.wait(kid, KEYS[9])
    assert book.take(KEYS[9], 3) == tuple(kids[:3]) and book.waits_for(KEYS[9])
    assert all(k.awaits is None for k in kids[:3]) and len(book) == 4
    book.forget(kids[4])
    assert book.take(KEYS[9], 2) == (kids[3], kids[5]) and len(book) == 1
    assert book.take(KEYS[9], 2) == (kids[6],) and not book.waits_for(KEYS[9]) and not book
