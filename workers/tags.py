"""A disk record's tag: where its object sits in the prefix tree, what a restarted shard
tells the metadata service its disk holds (``ObjectReport``).

Disk records carry a fixed 64-byte *tag* in front of the payload (covered by the disk tier's
checksum)::

    [0, 4)  magic b"HKVT"   [4, 5) format   [5, 6) has parent   [6, 8) reserved
    [8, 24) parent hash     [24, 28) depth (u32)   [28, 32) payload length (u32)
    [32, 40) version (u64)  [40, 48) lo (u64)      [48, 56) hi (u64)
    [56, 64) route (u64): the chain's route key, its metadata partition (0 before partitions)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from hkv_service.core.ids import BlockHash
from hkv_service.core.layout import Layout
from hkv_service.core.states import Kind

__all__ = ["TAG", "BlockTag", "decode_tagged", "encode_tagged", "tag_bytes"]


@dataclass(frozen=True, slots=True)
class BlockTag:
    """Where an object sits in the prefix tree; what ``ObjectReport`` needs after a restart."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    depth: int
    version: int = 0
    lo: int = 0
    hi: int = 0
    route: int = 0  # core/partitions.route_key of the chain's root (its metadata partition)


def tag_bytes(layout: Layout, column: int, tag: BlockTag) -> int:
    """Exactly the bytes of the object a disk record's tag describes (its payload's size)."""
    if layout.columns[column].kind is Kind.TAIL:
        return layout.object_bytes(column, tag.depth, tail_len=tag.hi)
    return layout.object_bytes(column, tag.depth, tag.lo, tag.hi)


TAG = struct.Struct("<4sBBH16sII QQQ Q")
_MAGIC = b"HKVT"
_NO_PARENT = bytes(16)
assert TAG.size == 64


def encode_tagged(tag: BlockTag, payload: Any) -> bytearray:
    """``tag header + payload`` in one buffer (one copy of the payload)."""
    view = memoryview(payload).cast("B")
    out = bytearray(TAG.size + len(view))
    TAG.pack_into(
        out, 0, _MAGIC, 1, tag.parent_hash is not None, 0, tag.parent_hash or _NO_PARENT,
        tag.depth, len(view), tag.version, tag.lo, tag.hi, tag.route,
    )
    out[TAG.size :] = view
    return out


def decode_tagged(block_hash: BlockHash, record: Any) -> tuple[BlockTag, memoryview]:
    """The tag and payload view of a verified record; ValueError if the framing is wrong."""
    view = memoryview(record).cast("B")
    if len(view) < TAG.size:
        raise ValueError(f"record of {len(view)} bytes is shorter than its tag")
    magic, fmt, has_parent, _, parent, depth, n, version, lo, hi, route = TAG.unpack_from(view)
    if magic != _MAGIC or fmt != 1 or len(view) != TAG.size + n:
        raise ValueError("record tag is malformed (magic, format or length)")
    tag = BlockTag(
        block_hash, BlockHash(bytes(parent)) if has_parent else None, depth, version, lo, hi,
        route,
    )
    return tag, view[TAG.size :]
