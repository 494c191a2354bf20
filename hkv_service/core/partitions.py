"""Metadata partitions: which of N service replicas holds an object, a lease, a chain.

The view can be split across N metadata partitions (``hkv up --service-replicas N``). Each
is a whole ``CacheState`` over part of the keys; nothing crosses between them::

    chain (a prompt's block hashes)  ->  partition of its root hash   (jump consistent hash
                                                                       of the root's first
                                                                       8 bytes)
    object id   (serial << 32 | slot) ->  serial % N    (each partition's serials step by N)
    lease id                          ->  lease_id % N  (likewise)
    a shard's pool block b of B       ->  the partition whose range [iB/N, (i+1)B/N) holds b

So a lookup, its lease and its handles touch one partition, a commit or a read goes to the
one that issued the id, and two partitions never hand out the same block of a shard's pool.

A hot root (one system prompt under every request) would put every lookup's whole walk and
every write on one partition. With ``range_blocks`` R > 0 a chain is split at fixed depth
ranges: range k (depths ``[kR, (k+1)R)``) is routed by its *anchor*, the hash at depth kR,
as a root is (range 0's anchor is the root). Each range is then a chain of its own in its
partition, starting at depth kR with no parent there. A lookup asks every range's partition
for the longest resume point p it accepts from its own entries alone (the funnel's layer-3
conditions are a conjunction over entries, each entry in one partition), and the client
iterates p <- min of the answers until every partition accepts the same p: a fixed point,
the answer one process holding the whole chain gives (workers/partitioned.py).
A shard vouching again for what it holds after a partition restarted knows which reports
are that partition's: a memory block by its range, a disk record by the route key its tag
carries (:func:`route_key` of the root hash).

Jump consistent hashing (Lamping and Veach, 2014) moves only ~1/N of the roots when N grows
by one. The partition count itself is fixed for a deployment's life: every client must be
given the partitions in the same order (a partition refuses a chain that is not its own, so
a list in another order fails loudly instead of splitting a prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

from .defaults import MAX_PARTITIONS
from .errors import InvalidInput

__all__ = [
    "MAX_PARTITIONS",
    "Partition",
    "check_range_blocks",
    "jump_hash",
    "partition_of_block",
    "partition_of_id",
    "partition_of_lease",
    "partition_of_root",
    "partition_of_route",
    "range_anchor",
    "ranges",
    "route_key",
]

_SLOT_BITS = 32  # core/objects.py: id = serial << 32 | slot
_U64 = (1 << 64) - 1


def jump_hash(key: int, buckets: int) -> int:
    """The bucket in ``[0, buckets)`` of a 64-bit ``key`` (jump consistent hash)."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & _U64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def route_key(root_hash: bytes) -> int:
    """The 64-bit key a chain is routed by: the first 8 bytes of its root hash (an xxh3-128
    digest, so already uniform)."""
    return int.from_bytes(root_hash[:8], "little")


def partition_of_route(key: int, count: int) -> int:
    return 0 if count == 1 else jump_hash(key, count)


def partition_of_root(root_hash: bytes, count: int) -> int:
    return 0 if count == 1 else jump_hash(route_key(root_hash), count)


def partition_of_id(object_id: int, count: int) -> int:
    return (object_id >> _SLOT_BITS) % count


def partition_of_lease(lease_id: int, count: int) -> int:
    return lease_id % count


def check_range_blocks(range_blocks: int, period: int) -> int:
    """``range_blocks`` if a layout of ``period`` hash blocks per LCM block can be split
    there (0: off; else a positive multiple of the period, so every range starts at a resume
    point), else InvalidInput."""
    if range_blocks < 0 or range_blocks % period:
        raise InvalidInput(f"range_blocks must be 0 (chains kept whole) or a positive multiple "
                           f"of {period} (the layout's period), got {range_blocks}")
    return range_blocks


def range_anchor(depth: int, range_blocks: int) -> int:
    """The depth of the hash that routes the block at ``depth`` (0 when chains are whole)."""
    return depth - depth % range_blocks if range_blocks else 0


def ranges(num_blocks: int, range_blocks: int) -> list[tuple[int, int]]:
    """The ranges ``[lo, hi)`` covering depths ``[0, num_blocks)``, in order."""
    if not range_blocks:
        return [(0, num_blocks)] if num_blocks else []
    return [(lo, min(lo + range_blocks, num_blocks)) for lo in range(0, num_blocks, range_blocks)]


def block_range(num_blocks: int, index: int, count: int) -> tuple[int, int]:
    """Blocks ``[lo, hi)`` of a pool of ``num_blocks`` that partition ``index`` hands out."""
    return index * num_blocks // count, (index + 1) * num_blocks // count


def partition_of_block(block: int, num_blocks: int, count: int) -> int:
    """The partition whose :func:`block_range` holds ``block``."""
    k = min(count - 1, block * count // num_blocks)
    while block < block_range(num_blocks, k, count)[0]:
        k -= 1
    while block >= block_range(num_blocks, k, count)[1]:
        k += 1
    return k


@dataclass(frozen=True, slots=True)
class Partition:
    """This view's place among the partitions: ``index`` of ``count`` (0 of 1: the whole)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_PARTITIONS:
            raise InvalidInput(f"partition count must be in [1, {MAX_PARTITIONS}], "
                               f"got {self.count}")
        if not 0 <= self.index < self.count:
            raise InvalidInput(f"partition index must be in [0, {self.count}), "
                               f"got {self.index}")

    @classmethod
    def parse(cls, text: str) -> Partition:
        """``"I/N"`` (e.g. ``"1/4"``); InvalidInput with the expected form otherwise."""
        index, sep, count = text.partition("/")
        try:
            if not sep:
                raise ValueError
            return cls(int(index), int(count))
        except ValueError:
            raise InvalidInput(f"a partition is written I/N (e.g. 0/1 or 2/4), got {text!r}"
                               ) from None

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def whole(self) -> bool:
        return self.count == 1

    def owns_root(self, root_hash: bytes) -> bool:
        return self.whole or partition_of_root(root_hash, self.count) == self.index

    def owns_id(self, object_id: int) -> bool:
        return self.whole or partition_of_id(object_id, self.count) == self.index
