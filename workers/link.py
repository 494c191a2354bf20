"""The seam between the data plane and a shard: a small link protocol, and its in-process link.

:class:`~workers.dataplane.DataPlane` talks to every shard through a :class:`ShardLink`:
``submit(method, *args, **kwargs)`` starts a call and returns a :class:`Pending`, whose
``result(timeout_s)`` gives the method's return value, re-raises what it raised, or raises
:class:`ShardUnavailable` when the shard died or did not answer in time. Calls to one shard run
one at a time in the order submitted; calls to different shards run in parallel.

* :class:`InProcessLink` calls a real :class:`~workers.shard.ShardActor` in this process. It
  copies the arguments when the call is submitted and the result before the shard runs its next
  call, as Ray does: the shard hands out views of its pools and reuses a packing buffer, and the
  read path's safety argument (a view is copied out before the bytes can change) rests on that
  copy. ``kill()`` is a crash: every call after it (and one still running) is unavailable.
* ``workers.raylink.RayLink`` is the same protocol over a Ray actor handle.

Nothing here imports Ray: the data plane, the shard and the pool do not need it.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, runtime_checkable

__all__ = ["Deferred", "InProcessLink", "Pending", "ShardLink", "ShardUnavailable"]


class ShardUnavailable(Exception):
    """The shard died, or did not answer within the deadline: recompute what it held.
    ``instance``: the shard process the call went to (``ShardActor.instance``), 0 if the link
    does not know it; a loss report names it, so it never ends a successor."""

    def __init__(self, shard: str, why: str, instance: int = 0) -> None:
        super().__init__(f"shard {shard} unavailable: {why}")
        self.shard = shard
        self.why = why
        self.instance = instance


class Pending(Protocol):
    def result(self, timeout_s: float) -> Any: ...


class Deferred:
    """A :class:`Pending` whose answer is computed when it is asked for (a call answered
    without the shard, or made only once its result is wanted)."""

    def __init__(self, fn: Callable[[float], Any]) -> None:
        self.fn = fn

    def result(self, timeout_s: float) -> Any:
        return self.fn(timeout_s)


@runtime_checkable
class ShardLink(Protocol):
    shard_id: str

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Pending: ...


class _Future:
    def __init__(self, shard: str, fut: Future[Any], instance: int) -> None:
        self.shard, self.fut, self.instance = shard, fut, instance

    def result(self, timeout_s: float) -> Any:
        try:
            return self.fut.result(timeout=timeout_s)
        except FutureTimeout:
            raise ShardUnavailable(self.shard, f"no answer within {timeout_s:g} s",
                                   self.instance) from None
        except ShardUnavailable as exc:
            exc.instance = self.instance
            raise


class InProcessLink:
    """A real shard object behind one call thread (a Ray actor's one-call-at-a-time order)."""

    def __init__(self, shard_id: str, shard: Any) -> None:
        self.shard_id = shard_id
        self.shard = shard
        self._dead = threading.Event()
        self._crash = threading.Lock()  # one crash at a time: two readers may crash it at once
        self._calls = ThreadPoolExecutor(1, thread_name_prefix=f"hkv-link-{shard_id}")

    @property
    def alive(self) -> bool:
        return not self._dead.is_set()

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Pending:
        instance = int(getattr(self.shard, "instance", 0))  # the process this call goes to
        if self._dead.is_set():
            fut: Future[Any] = Future()
            fut.set_exception(ShardUnavailable(self.shard_id, "the shard process died"))
            return _Future(self.shard_id, fut, instance)
        # serialised now, as Ray serialises a call's arguments when it is submitted
        sent = pickle.dumps((args, kwargs), protocol=5)
        return _Future(self.shard_id, self._calls.submit(self._run, method, sent), instance)

    def _run(self, method: str, sent: bytes) -> Any:
        if self._dead.is_set():
            raise ShardUnavailable(self.shard_id, "the shard process died")
        args, kwargs = pickle.loads(sent)
        result = getattr(self.shard, method)(*args, **kwargs)
        copied = pickle.loads(pickle.dumps(result, protocol=5))  # before the next call runs
        if self._dead.is_set():  # it died before answering
            raise ShardUnavailable(self.shard_id, "the shard process died")
        return copied

    def kill(self, timeout_s: float = 30.0) -> None:
        """Crash the shard: calls fail from now on; its heartbeats stop and its disk tier is
        closed once the call it may be running is over (LMDB is crash-safe either way; closing
        lets a successor open the same environment in this process). A dead process cannot
        die again: crashing a crashed shard is a no-op."""
        with self._crash:
            if self._dead.is_set():
                return
            self._dead.set()
            done = self._calls.submit(self.shard.shutdown)
            try:
                done.result(timeout=timeout_s)
            finally:
                self._calls.shutdown(wait=False, cancel_futures=True)

    def revive(self, shard: Any) -> None:
        """The crashed shard's successor takes over this link (a restarted Ray actor keeps its
        handle): calls go to ``shard`` from now on."""
        with self._crash:
            if not self._dead.is_set():
                raise RuntimeError(f"shard {self.shard_id} is alive; kill it first")
            self._revive(shard)

    def _revive(self, shard: Any) -> None:
        self.shard = shard
        self._calls = ThreadPoolExecutor(1, thread_name_prefix=f"hkv-link-{self.shard_id}")
        self._dead.clear()

    def close(self) -> None:
        """Shut the shard down in order (not a crash)."""
        if not self._dead.is_set():
            self.kill()
