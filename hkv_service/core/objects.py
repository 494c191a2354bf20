"""object id -> record, kept in a list slab rather than a dict.

A dict entry costs ~50-100 bytes per object; a slab slot costs 8. Ids stay unique forever:
``id = serial << 32 | slot``, so a freed and reused slot never answers to an old id (a late
commit for an evicted object is "unknown object", never a transition of its successor). Ids
start below 2**60 (serial < 2**28): a Python int that size takes 32 B, not 36, per object.
They reach 2**63 (a signed 64-bit field's limit) only after ~2**31 allocations.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from .ids import ObjectId
from .records import ObjRecord

__all__ = ["ObjectTable"]

_SLOT_BITS = 32
_SLOT_MASK = (1 << _SLOT_BITS) - 1


class ObjectTable:
    def __init__(self, serial_base: int | None = None, index: int = 0, count: int = 1) -> None:
        """``index``/``count``: a metadata partition's place (core/partitions.py): every
        serial it issues is ``index`` modulo ``count``, so an id names its partition."""
        self._slab: list[ObjRecord | None] = []
        self._free: list[int] = []
        # A random base per state view: ids issued before a service restart do not match ids
        # issued after it, so a pre-restart handle can never name a new object.
        base = random.SystemRandom().getrandbits(17) << 10 if serial_base is None else serial_base
        # the first serial issued is the multiple of count at or below base, plus index
        self._serial = base // count * count + index - count
        self._step = count
        self._count = 0

    def new_id(self) -> ObjectId:
        """Reserve a slot and return the id a new record must carry; then :meth:`put` it."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._slab)
            self._slab.append(None)
        self._serial += self._step
        return ObjectId(self._serial << _SLOT_BITS | slot)

    def put(self, rec: ObjRecord) -> None:
        slot = rec.object_id & _SLOT_MASK
        assert self._slab[slot] is None, "object slot reused while occupied"
        self._slab[slot] = rec
        self._count += 1

    def get(self, object_id: int) -> ObjRecord | None:
        slot = object_id & _SLOT_MASK
        if slot >= len(self._slab):
            return None
        rec = self._slab[slot]
        return rec if rec is not None and rec.object_id == object_id else None

    def __getitem__(self, object_id: int) -> ObjRecord:
        rec = self.get(object_id)
        if rec is None:
            raise KeyError(object_id)
        return rec

    def __contains__(self, object_id: object) -> bool:
        return isinstance(object_id, int) and self.get(object_id) is not None

    def pop(self, object_id: int) -> ObjRecord | None:
        rec = self.get(object_id)
        if rec is not None:
            slot = object_id & _SLOT_MASK
            self._slab[slot] = None
            self._free.append(slot)
            self._count -= 1
        return rec

    def slots(self, start: int, stop: int) -> list[ObjRecord]:
        """The records in slots ``[start, stop)`` (a walk in slices: ``slot_count`` bounds
        it), for a caller that must not hold the view's lock over all of them."""
        return [r for r in self._slab[start:stop] if r is not None]

    @property
    def slot_count(self) -> int:
        return len(self._slab)

    def values(self) -> Iterator[ObjRecord]:
        return (r for r in self._slab if r is not None)

    def __len__(self) -> int:
        return self._count
