"""The token ids writers supplied, per hash block, for the KV event stream (issue 39).

A router keys blocks by their tokens (llm-d hashes ``token_ids`` itself), so a stored
event should carry them. The state view keeps no tokens (a record is metadata only), so the
edge keeps what a writer's ``Allocate`` carried (``AllocateRequest.token_ids``) in a bounded
LRU book, hash -> the hash block's tokens (int32 little-endian), and the publisher joins a
block's span from it. A block whose tokens were never supplied (or fell out of the book) is
published with none: the event is still right, only less useful to a token-keyed router.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hkv_service.core.errors import InvalidInput

__all__ = ["DEFAULT_TOKEN_BLOCKS", "TokenBook"]

DEFAULT_TOKEN_BLOCKS = 1 << 16  # hash blocks kept: 16 MiB of tokens at 64 tokens a block


class TokenBook:
    def __init__(self, hash_block: int, capacity: int = DEFAULT_TOKEN_BLOCKS) -> None:
        self.hash_block = hash_block
        self.capacity = capacity
        self._book: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, hashes: Sequence[bytes], packed: bytes) -> None:
        """InvalidInput unless ``packed`` is ``hash_block`` int32 tokens per hash (asked
        before the call allocates: a refused call reserves nothing)."""
        if len(packed) != 4 * self.hash_block * len(hashes):
            raise InvalidInput(f"token_ids hold {len(packed) // 4} tokens; {len(hashes)} "
                               f"hashes of {self.hash_block} tokens need "
                               f"{len(hashes) * self.hash_block}")

    def note(self, hashes: Sequence[bytes], packed: bytes) -> None:
        """``packed``: int32 LE tokens, ``hash_block`` per hash of ``hashes``, in order."""
        self.check(hashes, packed)
        step = 4 * self.hash_block
        with self._lock:
            book = self._book
            for i, h in enumerate(hashes):
                book[h] = packed[i * step:(i + 1) * step]
                book.move_to_end(h)
            while len(book) > self.capacity:
                book.popitem(last=False)

    def tokens(self, span: Sequence[bytes]) -> list[int]:
        """The tokens of the hash blocks of ``span``, in order; [] unless all are known."""
        with self._lock:
            parts = [self._book.get(h) for h in span]
        if any(p is None for p in parts):
            return []
        joined = b"".join(p for p in parts if p is not None)
        return [int(t) for t in np.frombuffer(joined, "<i4")]

    def __len__(self) -> int:
        return len(self._book)
