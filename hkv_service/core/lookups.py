"""The lookup path: a request in, a :class:`~hkv_service.core.match.Match` out.

::

    lookup(req)
      validate (funnel.validate_request, partition, range, lease TTL)
      clean the walk's reach of a lost owner's records       (Tables.clean: lazy burial)
      expired leases let go                                   (LeaseBook.reap)
      memo of this key?  else of the prefix before the first miss?     (core/memo.py)
      else run_funnel: the walk (by certified segments where it can) and layer 3
      count it, age the path it used                          (PrefixTree.age)
      lease: pin the served records                           (Packer.resolve)
      pack the handle columns                                 (Packer.columns)
      a complete walk (or one stopped at a plain miss), seen before: keep it as a memo

A lookup changes no record's state but buries dead records it meets, ages entries, fills
the memo and may certify walk segments and summarise pending entries; all of it derived.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from .api import LookupRequest, StateConfig
from .funnel import Downgrade, FunnelResult, check_hash_lengths, run_funnel, validate_request
from .inputs import check_range, check_root, lease_ttl_exceeded
from .match import KeyFields, Match, Memo
from .memo import LookupMemo
from .packing import Packer
from .segments import first_missing, walk_blocks
from .tables import Tables

__all__ = ["Lookups"]


class Lookups:
    """The lookups of one state view, and its lookup memo; called under its lock."""

    def __init__(self, tables: Tables, packer: Packer, config: StateConfig) -> None:
        self.t = tables
        self.packer = packer
        self.layout = tables.layout
        self.segment_blocks = packer.segment_blocks
        self.memo = LookupMemo(config.memo_capacity, config.memo_max_bytes,
                               config.memo_min_blocks)

    def lookup(self, req: LookupRequest) -> Match:
        t, packer = self.t, self.packer
        limit = validate_request(req, self.layout, hash_lengths=False)
        check_root(t.partition, req.block_hashes)
        if t.range_blocks or req.first_block:  # (a whole chain's lookup: no call)
            check_range(t.range_blocks, req.first_block, len(req.block_hashes), "lookup")
        if req.lease_ttl_s > t.config.max_lease_ttl_s:
            raise lease_ttl_exceeded(req.lease_ttl_s, t.config.max_lease_ttl_s)
        # what the walk reads is alive (a lost owner's objects are buried lazily)
        first = req.first_block
        if t.reaping:  # (no copy of the hashes on the hot path otherwise)
            t.clean(req.block_hashes[: -(-limit // self.layout.hash_block) - first],
                    walk_need=req.alignment)
        now = t.clock()
        t.leases.reap(now)
        key = self.memo.key(req, limit, t.owners_epoch)
        memo = self.memo.get(key, req.block_hashes) if key is not None else None
        stop_key = None
        # A range of a split chain has its own memo, not a prefix's: its answer past a
        # miss is its partition's part of a longer question, which the client assembles
        whole = not first and not req.open_end
        if memo is None and key is not None and whole:
            memo = self._prefix_memo(req, limit)
            repeatable = memo is None
        else:
            repeatable = True
        if memo is not None and memo.result is not None:
            result = memo.result
            t.counters.events["lookup_memo_hit"] += 1
        else:
            result = run_funnel(t.index, self.layout, req, limit, self.segment_blocks,
                                t.align_of)  # changes no state (summaries)
            # The walk found the first matched/H hashes in the index, whose keys are all 16
            # bytes (allocate and confirm check them): only the rest can be malformed.
            check_hash_lengths(req.block_hashes, max(
                0, result.matched_tokens // self.layout.hash_block - first))
            stop_key = (self._stop_key(req, result, limit) if key is not None and whole
                        else None)
        self._count_lookup(result.usable_tokens, limit, result.downgrades)
        usable, entries = result.usable_tokens, result.entries
        if usable:
            t.tree.age(entries)
        records = memo.records if memo is not None else None
        lease_id = None
        if req.lease_ttl_s > 0 and usable:
            if records is None:
                records = packer.resolve(entries, usable, req.alignment, first)
                if memo is not None:
                    memo.records = records
            pinned = [r for recs in records.values() for r in recs]
            if pinned:
                lease_id = t.leases.open(pinned, now + req.lease_ttl_s).lease_id
        columns = memo.columns if memo is not None else packer.columns(req, result, records)
        match = Match(
            result.usable_tokens, result.matched_tokens, result.downgrades, lease_id,
            dict(columns) if columns else {}, memo if lease_id is None else None,
            repeatable=repeatable,
        )
        if memo is None and result.walked:
            # Only a walk that found every hash it looked at depends on its entries alone;
            # one that stopped at a miss answers what its prefix alone would (kept as the
            # prefix's memo).
            complete = result.matched_tokens == limit // self.layout.hash_block * \
                self.layout.hash_block
            keep, hashes = ((key, req.block_hashes) if complete else
                            (stop_key, req.block_hashes[: len(result.walked)]))
            if keep is not None:
                self.memo.put(keep, hashes, match if lease_id is None else
                              replace(match, lease_id=None), result, records)
        return match

    def _stop_key(self, req: LookupRequest, result: FunnelResult, limit: int
                  ) -> KeyFields | None:
        """The memo key of the prefix a walk stopped at, where the lookup's answer is that
        prefix's: the walk stopped at a hash the index lacks (a plain miss adds no downgrade),
        before the limit. A stop at an entry that is there but not ready answers with its
        reason, and is not a prefix's answer (nor found by :meth:`_prefix_memo`: that entry
        is present)."""
        n = len(result.walked)
        if n * self.layout.hash_block >= limit // self.layout.hash_block * self.layout.hash_block:
            return None  # complete: the request's own key
        if self.t.index.get(req.block_hashes[n]) is not None:
            return None
        return self.memo.key_at(req, n, n * self.layout.hash_block, self.t.owners_epoch)

    def _prefix_memo(self, req: LookupRequest, limit: int) -> Memo | None:
        """The memo of the prefix a walk of ``req`` would stop at, found without walking:
        bisect for the first hash the index lacks (present hashes come before absent ones
        along a chained prefix), then take the live memo of the hashes before it if it is byte
        for byte this request's. Sound however the stop was found: the memo stands, so a walk
        would accept the same entries, and stop there at a plain miss."""
        hashes, hb = req.block_hashes, self.layout.hash_block
        lo = first_missing(self.t.index, hashes, limit // hb)
        if lo * hb >= limit // hb * hb:
            return None  # no miss before the limit: the request's own key, not a prefix's
        key = self.memo.key_at(req, lo, lo * hb, self.t.owners_epoch)
        memo = self.memo.get(key, hashes, lo) if key is not None else None
        if memo is None or memo.result is None:
            return None
        check_hash_lengths(hashes, lo)  # the walk's answer past the stop: a malformed hash
        return memo

    def replay(self, memo: Memo) -> bool:
        """Repeat the lease-free lookup ``memo`` answered (``Match.memo``): counted and aged
        like any lookup, with no request to decode or walk. False once anything on its path
        or the owner table changed: look the request up afresh."""
        t = self.t
        result = memo.result
        if not memo.live or result is None or memo.key.owners_epoch != t.owners_epoch:
            return False
        t.leases.reap(t.clock())
        self.memo.touch(memo)
        t.counters.events["lookup_memo_hit"] += 1
        self._count_lookup(result.usable_tokens, memo.key.limit, result.downgrades)
        if result.usable_tokens:
            t.tree.age(result.entries)
        return True

    def _count_lookup(self, usable: int, limit: int, downgrades: Iterable[Downgrade]) -> None:
        t = self.t
        t.tree.tick += 1
        kind = "miss" if usable == 0 else ("hit" if usable + self.layout.lcm > limit else "partial")
        t.counters.lookups[kind] += 1
        for d in downgrades:
            t.counters.downgrades[d.reason] += 1

    def check_placed(self, req: LookupRequest) -> None:
        """Raise :class:`MisplacedHash` if ``req``'s first hash is the hash of another block
        than the one it is given for (a batch is refused with it before any item is looked
        up; a hash out of place further in is refused by the walk)."""
        # the walk's own rule, on the first hash (need 0: no gate asked)
        walk_blocks(self.t.index, req.block_hashes[:1], 0, [], None, None, req.first_block)
