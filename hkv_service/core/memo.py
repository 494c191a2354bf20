"""Lookup memo: a long lookup's result, kept until anything on its path changes.

Workers look the same long prefix up again and again (a shared system prompt, a document many
requests ask about), and between two such lookups nothing on that path usually changes; yet the
funnel's walk plus packing costs ~0.15 us per block in Python (``hkv bench core``:
``lookup_with_handles_us`` 291-320 for 2,048 blocks, against 4 for a memo hit). A
memo keeps the funnel's result and the packed handle columns of a lookup whose walk matched
every hash it was given, and registers itself on every entry of that path.
``contracts.summarise`` (every change to an entry's records passes through it, as it does for
the entry's cached handle row, or through ``contracts.defer``, which leaves the summary to the
next walk) drops the entry's memos, so a memo never outlives the state it was computed from::

    lookup(key, hashes) --hit (live, same bytes)--> result, columns          (O(1) + memcmp)
                        --miss--> bisect for the first missing hash k: the memo of
                                  hashes[:k] live and byte-equal? --> its answer (not replayed)
                        --else--> walk --complete walk, key seen before--> new memo
                                       --stopped at a miss at k, seen before--> memo of [:k]
    any change to entry e --> summarise(e) or defer(e) --> every memo registered on e is dropped

A walk that stops at a hash the index lacks answers what a lookup of the hashes before it
would (a plain miss adds no downgrade), so new questions over one cached document share the
document's memo (``Lookups._prefix_memo`` says why finding the stop by bisection is sound).

A memo is made on the second lookup of the same key (a prefix looked up once never pays for
the registration), and the table is bounded by count and bytes (least recently used first).
The key holds everything else a result depends on: the hashes' count and last hash, the
token limit, alignment, handles or not, the reader's ABI, where the hashes start and whether
the chain goes on past them (a range of a chain split across partitions is memoised as its
own question; the bisection for a prefix's memo is for whole chains only), and the owners'
epoch (an owner registering changes the stride table every handle column carries).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from .funnel import FunnelResult, LookupRequest
from .ids import BLOCK_HASH_BYTES, BlockHash, PackedHashes
from .match import KeyFields, Match, Memo, MemoKey
from .records import ObjRecord, drop_memos, register

__all__ = ["LookupMemo", "Memo", "MemoKey", "drop_memos", "register"]


def _equal(packed: bytes, hashes: Sequence[BlockHash], count: int | None) -> bool:
    """``packed`` is ``hashes`` (their first ``count``), byte for byte."""
    if count is None:
        return packed == _packed(hashes)
    if isinstance(hashes, PackedHashes):  # one memcmp, no copy of the prefix
        return len(packed) == BLOCK_HASH_BYTES * count and hashes.data.startswith(packed)
    return packed == _packed(hashes[:count])


def _packed(hashes: Sequence[BlockHash]) -> bytes:
    return PackedHashes.of(hashes).data


class LookupMemo:
    """The memo table of one state view; called under the view's lock."""

    def __init__(self, capacity: int = 1024, max_bytes: int = 64 << 20,
                 min_blocks: int = 32) -> None:
        self.capacity, self.max_bytes, self.min_blocks = capacity, max_bytes, min_blocks
        # Set by an edge that sends matches somewhere (the gRPC server): a memo then keeps its
        # match's encoding too, and a repeated lookup's reply is a copy of those bytes.
        self.encoder: Callable[[Match], bytes] | None = None
        self.nbytes = 0
        self.hits = self.misses = 0
        self._memos: OrderedDict[KeyFields, Memo] = OrderedDict()
        self._seen: OrderedDict[KeyFields, None] = OrderedDict()  # keys looked up once

    def __len__(self) -> int:
        return len(self._memos)

    def key(self, req: LookupRequest, limit: int, owners_epoch: int) -> KeyFields | None:
        """The memo key of ``req``; None where a walk is cheap enough not to memoise."""
        return self.key_at(req, len(req.block_hashes), limit, owners_epoch)

    def key_at(self, req: LookupRequest, count: int, limit: int, owners_epoch: int
               ) -> KeyFields | None:
        """The memo key of ``req`` cut to its first ``count`` hashes, looked up to ``limit``
        tokens: the key a lookup of just that prefix has when ``limit`` is all of it."""
        if self.capacity <= 0 or self.max_bytes <= 0 or count < self.min_blocks:
            return None
        abi = tuple(sorted(req.reader_abi.items())) if req.reader_abi else ()
        return (req.block_hashes[count - 1], count, limit, req.alignment, req.handles, abi,
                req.first_block, req.open_end, owners_epoch)

    def get(self, key: KeyFields, hashes: Sequence[BlockHash], count: int | None = None
            ) -> Memo | None:
        """The live memo for ``key`` whose prefix is byte-equal to ``hashes`` (to their first
        ``count``, if given; a malformed hash raises BadHash here, as the walk would)."""
        memo = self._memos.get(key)
        if memo is not None and memo.live and _equal(memo.hashes, hashes, count):
            self._memos.move_to_end(key)
            self.hits += 1
            return memo
        self.misses += 1
        if memo is not None and not memo.live:
            self._forget(key)
        return None

    def touch(self, memo: Memo) -> None:
        """``memo`` answered again (a replay): most recently used now."""
        self.hits += 1
        if self._memos.get(memo.key) is memo:
            self._memos.move_to_end(memo.key)

    def put(self, key: KeyFields, hashes: Sequence[BlockHash], match: Match, result: FunnelResult,
            records: dict[str, tuple[ObjRecord, ...]] | None) -> Memo | None:
        """Keep ``match`` (lease-free) if ``key`` was looked up before (else remember that it
        was)."""
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            return None
        del self._seen[key]
        packed = _packed(hashes)
        columns = match.columns if match.columns else None
        wire = self.encoder(match) if self.encoder is not None else None
        nbytes = (len(packed) + sum(len(c.records) for c in (columns or {}).values())
                  + len(wire or b""))
        if nbytes > self.max_bytes:
            return None
        old = self._memos.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
            old.drop()
        memo = Memo(MemoKey(*key), packed, result, columns, records, nbytes, wire)
        register(memo, result.walked)
        self._memos[key] = memo
        self.nbytes += nbytes
        while len(self._memos) > self.capacity or self.nbytes > self.max_bytes:
            self._forget(next(iter(self._memos)))
        return memo

    def _forget(self, key: KeyFields) -> None:
        memo = self._memos.pop(key)
        self.nbytes -= memo.nbytes
        memo.drop()
