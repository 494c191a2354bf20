"""Identities used across the core. NewTypes so a hash is never confused with an id."""

from __future__ import annotations

from typing import NewType

__all__ = [
    "BLOCK_HASH_BYTES",
    "BlockHash",
    "CaptureId",
    "GroupName",
    "LeaseId",
    "ObjectId",
    "ShardId",
]

BLOCK_HASH_BYTES = 16  # xxh3-128 digest

BlockHash = NewType("BlockHash", bytes)
ObjectId = NewType("ObjectId", int)
ShardId = NewType("ShardId", str)
GroupName = NewType("GroupName", str)
LeaseId = NewType("LeaseId", int)
CaptureId = NewType("CaptureId", int)
