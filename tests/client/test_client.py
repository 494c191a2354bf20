"""Client behaviour that needs no domain logic: retries only on UNAVAILABLE, bounded."""

from __future__ import annotations

import time

import pytest

from hkv_service.client import MetadataClient, RetryPolicy
from hkv_service.core.errors import Unavailable


def test_idempotent_call_retries_then_raises_unavailable() -> None:
    policy = RetryPolicy(attempts=3, first_backoff_s=0.1, max_backoff_s=0.1)
    with MetadataClient("127.0.0.1:1", timeout_s=0.5, retry=policy) as c:
        start = time.monotonic()
        with pytest.raises(Unavailable):
            c.stats()
        assert time.monotonic() - start >= 0.2  # two backoffs: it did retry
        start = time.monotonic()
        with pytest.raises(Unavailable):
            c.evict(1)  # not idempotent: one attempt, no backoff
        assert time.monotonic() - start < 0.2
