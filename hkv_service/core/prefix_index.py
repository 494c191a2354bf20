"""The state view's index, block hash -> prefix entry, held as :data:`PARTS` dicts.

One dict of every entry has a stop-the-world step: CPython grows (or compacts) a dict in one
go, copying all of it, when the inserts since the last resize have used up its free slots,
and churn (entries made for new prompts, freed when evicted) keeps using them up at a steady
size, under the view's lock and the GIL. ``hkv bench scale`` times that insert at each size
(``flat_index_resize_ms``, one dict of every entry, beside ``index_resize_ms``, the fullest
part; ``benchmarks/README.md``, runs I and J). Split by the hash's first byte (block hashes
are xxh3 digests: uniform), each part holds ~1/256 of the entries. The rule that picks a part
(``parts[h[0]]``) is inlined where a lookup is hot (``segments._from_index``, the
re-confirm's checked hashes in ``Rebuild``); ``test_prefix_index`` pins it.

Reads pay one list subscript and one byte read more than a flat dict (``hkv bench core``'s
``lookup_vs_dict_walk`` shows it on the block walk).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain, islice

from .ids import BlockHash
from .records import PrefixEntry

__all__ = ["PARTS", "Orphans", "PrefixIndex"]

PARTS = 256  # one per value of a hash's first byte
_NONE: dict[BlockHash, PrefixEntry] = {}  # the part of a key no entry can have (never filled)


class PrefixIndex:
    """A mapping of block hash to entry; ``parts[h[0]]`` holds ``h``."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[dict[BlockHash, PrefixEntry]] = [{} for _ in range(PARTS)]

    def part_of(self, h: object) -> dict[BlockHash, PrefixEntry]:
        """The part that holds ``h``; an empty one for what is not a block hash (no entry
        has such a key: the callers' own checks name it)."""
        try:
            return self.parts[h[0]]  # type: ignore[index]
        except (IndexError, TypeError, KeyError):
            return _NONE

    def get(self, h: object, default: PrefixEntry | None = None) -> PrefixEntry | None:
        try:  # (part_of inlined: one frame a call, the re-confirm makes ~5 a report)
            return self.parts[h[0]].get(h, default)  # type: ignore[index, call-overload, no-any-return]
        except (IndexError, TypeError, KeyError):
            return default

    def __getitem__(self, h: BlockHash) -> PrefixEntry:
        return self.part_of(h)[h]

    def __setitem__(self, h: BlockHash, entry: PrefixEntry) -> None:
        self.parts[h[0]][h] = entry  # (keys are checked 16-byte hashes: inputs.check_hashes)

    def __delitem__(self, h: BlockHash) -> None:
        del self.part_of(h)[h]

    def __contains__(self, h: object) -> bool:
        return h in self.part_of(h)

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    def __bool__(self) -> bool:
        return any(self.parts)

    def __iter__(self) -> Iterator[BlockHash]:
        return chain.from_iterable(self.parts)

    def keys(self) -> Iterator[BlockHash]:
        return iter(self)

    def values(self) -> Iterator[PrefixEntry]:
        return chain.from_iterable(p.values() for p in self.parts)

    def items(self) -> Iterator[tuple[BlockHash, PrefixEntry]]:
        return chain.from_iterable(p.items() for p in self.parts)

    def largest_part(self) -> int:
        """Entries in the fullest part: what one resize can copy."""
        return max(map(len, self.parts))


class Orphans:
    """Entries made before their parent's: a re-confirm in random order reports a block
    before the block above it (a chain's report names its parent's hash, whose entry is not
    there yet). Each waits for the entry of that hash (its ``awaits``), which adopts it when
    it is made (``PrefixTree.entry_under``): else it stayed parentless for good once no
    later report named it, and what walks up the parents (the SWA policy's resume-point
    counts) stopped short there, and its parent, counting no child, could be dropped under
    it. A hash most often has one orphan waiting (a chain), kept bare; siblings in a dict.
    (A re-confirm of one owner of eight leaves ~90% of its entries waiting: the parents are
    the other owners'.) Those that wait for an entry made are adopted a slice per lock
    hold (``tree.ADOPT_SLICE``, ``PrefixTree.adopt_some``): all at once, a root with hundreds
    of thousands of children would hold the lock past the 50 ms pause target."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: dict[BlockHash, PrefixEntry | dict[PrefixEntry, None]] = {}

    def wait(self, child: PrefixEntry, parent_hash: BlockHash) -> None:
        """``child`` waits for the entry of ``parent_hash`` (the first hash named stays)."""
        if child.awaits is not None:
            return
        child.awaits = parent_hash
        got = self._waiting.setdefault(parent_hash, child)
        if got is child:
            return
        if isinstance(got, dict):
            got[child] = None
        else:
            self._waiting[parent_hash] = {got: None, child: None}

    def take(self, parent_hash: BlockHash, limit: int) -> tuple[PrefixEntry, ...]:
        """Up to ``limit`` (> 0) of the entries that wait for ``parent_hash`` (its entry was
        made), first come first, waiting no more; the rest wait on (:meth:`waits_for`)."""
        got = self._waiting.get(parent_hash)
        if got is None:
            return ()
        if not isinstance(got, dict) or len(got) <= limit:
            del self._waiting[parent_hash]
            children = tuple(got) if isinstance(got, dict) else (got,)
        else:
            children = tuple(islice(got, limit))
            for child in children:
                del got[child]
        for child in children:
            child.awaits = None
        return children

    def waits_for(self, parent_hash: BlockHash) -> bool:
        """Whether some entry still waits for the entry of ``parent_hash``."""
        return parent_hash in self._waiting

    def forget(self, child: PrefixEntry) -> None:
        """``child`` left the index (or was adopted): it waits for nothing."""
        parent_hash, child.awaits = child.awaits, None
        if parent_hash is None:
            return
        got = self._waiting[parent_hash]
        if isinstance(got, dict):
            del got[child]
            if got:
                return
        del self._waiting[parent_hash]

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return sum(len(g) if isinstance(g, dict) else 1 for g in self._waiting.values())
