"""The disk tier's one helper thread: checksums and record encoding run on it *beside* the
caller's copy or commit, so that the CPU work of a transfer overlaps the memory or disk work.

One thread per process (LMDB's copies, ``np.copyto``, zstd and xxh3-128 of buffers over
64 KiB all release the GIL, so two threads keep both cores of a small host busy; more threads
measured no faster there). It is created on first use and forgotten in a forked child, where
the thread is gone but the executor would still count it and hang the first submit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

__all__ = ["run_beside"]

P = ParamSpec("P")
T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None


def _forget_pool() -> None:
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def run_beside(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
    """``fn(*args, **kwargs)`` on the helper thread; jobs run one at a time, in order."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkv-disk-helper")
    return _pool.submit(fn, *args, **kwargs)
