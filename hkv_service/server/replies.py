"""Replies to repeated Lookup requests, kept as bytes while the lookup memo behind them stands.

A worker that looks the same prefix up again sends the very same request bytes. When the state
view answered such a request from its lookup memo (``Match.memo``), the reply is kept here
keyed by the request's bytes; the next identical request is answered with a copy of those bytes
after ``CacheState.replay(memo)`` confirms, under the view's lock, that nothing on the path
changed (and counts the lookup like any other). No protobuf is decoded, no request validated
again, no walk: the same bytes mean the same request, and a live memo means the same answer.
Bounded by count and bytes, least recently used first. Leased lookups never come here (a
lease is new state; their matches carry no memo).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from hkv_service.core.memo import Memo

__all__ = ["ReplyCache"]

_TAIL = 48  # request bytes in the key beside the length; the full request is compared on a hit


@dataclass(frozen=True, slots=True)
class _Reply:
    request: bytes
    memo: Memo
    reply: bytes


class ReplyCache:
    def __init__(self, max_entries: int = 256, max_bytes: int = 32 << 20) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.nbytes = 0
        self._items: OrderedDict[tuple[int, bytes], _Reply] = OrderedDict()
        self._lock = threading.Lock()  # RPC threads share the cache

    def __len__(self) -> int:
        return len(self._items)

    def get(self, request: bytes) -> tuple[Memo, bytes] | None:
        key = (len(request), request[-_TAIL:])
        with self._lock:
            item = self._items.get(key)
            if item is None or item.request != request:
                return None
            self._items.move_to_end(key)
            return item.memo, item.reply

    def put(self, request: bytes, memo: Memo, reply: bytes) -> None:
        size = len(request) + len(reply)
        if self.max_entries <= 0 or size > self.max_bytes:
            return
        key = (len(request), request[-_TAIL:])
        with self._lock:
            self._pop(key)
            self._items[key] = _Reply(request, memo, reply)
            self.nbytes += size
            while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
                self._pop(next(iter(self._items)))

    def discard(self, request: bytes) -> None:
        with self._lock:
            self._pop((len(request), request[-_TAIL:]))

    def _pop(self, key: tuple[int, bytes]) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.nbytes -= len(item.request) + len(item.reply)
