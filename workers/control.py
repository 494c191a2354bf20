"""The write claims of a worker on a shard's node, over a local socket instead of Ray.

A write through the shared segment (:mod:`workers.shared`) takes two calls to the shard,
``claim_blocks`` and ``finish_blocks``, and the data plane's write one more, ``settle_blocks``;
through Ray each costs ~1 ms here, more than copying a few MiB. The shard serves those (and
``release_blocks``) on a Unix socket in the abstract namespace (no file to leave behind; gone
with the process), named with the segment's nonce; a round trip costs tens of microseconds.
Only processes of the shard's own user are served (``SO_PEERCRED``), only these methods, each
under the shard's lock as a Ray call is, one connection's calls in the order they were sent.

Frames: 8-byte little-endian length, then a pickle of ``(method, args, kwargs)``; the answer is
``(True, result)`` or ``(False, exception)``, one per call, in order. The client may send
calls before the answers of earlier ones are read (:meth:`ControlClient.post`: a call whose
answer no one waits for, e.g. a write's finish): a later call on the connection is taken by
the shard only after it, so the next answer read proves it was done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import socket
import struct
import threading
import time
from typing import Any

from .link import ShardUnavailable
from .shm import fd_ready

__all__ = ["SERVED", "ControlClient", "ControlServer"]

log = logging.getLogger(__name__)

SERVED = frozenset({"claim_blocks", "finish_blocks", "release_blocks", "settle_blocks"})
_LEN = struct.Struct("<Q")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CHUNK = 1 << 16  # bytes asked of the socket per recv (a frame is a few hundred)
SEND_S = 10.0  # a client waits this long at most for room in the socket's buffer


def _send(sock: socket.socket, obj: Any, timeout_s: float | None = None) -> None:
    """One frame, in one syscall unless the socket's buffer is full (then, on a client,
    waiting at most ``timeout_s`` for room)."""
    data = pickle.dumps(obj, protocol=5)
    frame = memoryview(_LEN.pack(len(data)) + data)
    if timeout_s is None:
        sock.sendall(frame)
        return
    deadline = time.monotonic() + timeout_s
    while frame:
        try:
            frame = frame[sock.send(frame, socket.MSG_DONTWAIT) :]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0 or not fd_ready(sock.fileno(), select.POLLOUT, left):
                raise TimeoutError("the shard takes no more calls") from None


class _Frames:
    """The frames arriving on one socket: as many bytes as there are taken per ``recv``
    (a frame and its length in one syscall, not two), split into frames here. ``spin_s``:
    how long a wait polls the socket without sleeping before it blocks (the answer to a call
    comes back within tens of microseconds; waking a sleeping thread costs as much)."""

    def __init__(self, sock: socket.socket, spin_s: float = 0.0) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.spin_s = spin_s
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def next(self, timeout_s: float | None = None) -> Any:
        """The next frame; socket.timeout past ``timeout_s`` (None: no deadline)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if len(self.buf) >= _LEN.size:
                n = _LEN.size + _LEN.unpack_from(self.buf)[0]
                if len(self.buf) >= n:
                    frame = pickle.loads(self.buf[_LEN.size : n])
                    del self.buf[:n]
                    return frame
            self._fill(deadline)

    def _fill(self, deadline: float | None) -> None:
        if deadline is None and not self.spin_s:
            chunk = self.sock.recv(_CHUNK)  # (a blocking socket: one syscall)
            if not chunk:
                raise ConnectionError("the peer closed the socket")
            self.buf += chunk
            return
        spin_until = time.perf_counter() + self.spin_s
        while True:
            try:
                chunk = self.sock.recv(_CHUNK, socket.MSG_DONTWAIT)
                break
            except BlockingIOError:
                pass
            if time.perf_counter() < spin_until:
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("no answer in time")
            if not self._poll.poll(None if left is None else max(1, int(left * 1000))):
                raise TimeoutError("no answer in time")
        if not chunk:
            raise ConnectionError("the peer closed the socket")
        self.buf += chunk


class ControlServer:
    """Serves :data:`SERVED` methods of ``target`` on ``name`` (abstract), a thread per peer."""

    def __init__(self, target: Any, name: str) -> None:
        self.target, self.name = target, name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(64)
        self._closed = threading.Event()
        self._peers: set[socket.socket] = set()
        self._peers_lock = threading.Lock()
        threading.Thread(target=self._accept, name="hkv-control", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            _, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _CRED.size))
            if uid != os.getuid():
                conn.close()
                continue
            with self._peers_lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._peers.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="hkv-control-peer",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            self._loop(conn)
        with self._peers_lock:
            self._peers.discard(conn)

    def _loop(self, conn: socket.socket) -> None:
        frames = _Frames(conn)
        while not self._closed.is_set():
            try:
                method, args, kwargs = frames.next()
            except Exception:  # closed, or a frame that is no call: this peer is done
                return
            try:
                if method not in SERVED:
                    raise ValueError(f"{method!r} is not served here")
                answer: tuple[bool, Any] = (True, getattr(self.target, method)(*args,
                                                                               **kwargs))
            except Exception as exc:
                answer = (False, exc)
            try:
                _send(conn, answer)
            except OSError:
                return

    def close(self) -> None:
        """Stop serving at once: no claim reaches a shard that shut down."""
        self._closed.set()
        with self._peers_lock:
            socks = [self._sock, *self._peers]
            self._peers.clear()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class ControlClient:
    """One connection to a shard's :class:`ControlServer`, shared by this process's threads.

    :meth:`send` a call and get a ticket, :meth:`answer` it later (the calls of several
    shards then overlap); :meth:`call` does both; :meth:`post` sends a call whose answer no
    one waits for: it is read with the next answer anyone waits for (a failure is logged and
    counted in ``refused``), or by :meth:`sync`. A connection that failed once (closed, silent
    past a deadline, out of step) is closed: every call on it from then on raises
    ShardUnavailable. A forked child never uses its parent's connection (it raises too)."""

    def __init__(self, shard_id: str, name: str, timeout_s: float = 10.0) -> None:
        self.shard_id = shard_id
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect("\0" + name)
        except OSError:
            self._sock.close()
            raise
        # blocking from now on: waits go through _Frames's poll (a socket with a timeout
        # polls before every recv: two syscalls where one does)
        self._sock.settimeout(None)
        self._pid = os.getpid()
        self._frames = _Frames(self._sock)
        self._lock = threading.Lock()  # one sender or reader at a time
        self._sent = 0  # tickets given out (= calls sent)
        self._read = 0  # answers read
        self._answers: dict[int, tuple[bool, Any]] = {}  # read, not yet asked for
        self._posted: set[int] = set()  # tickets no one asks for
        self._dead: str | None = None
        self.refused = 0  # posted calls that failed

    @property
    def in_flight(self) -> int:
        """Calls sent whose answers were not read yet."""
        return self._sent - self._read

    def send(self, method: str, *args: Any, **kwargs: Any) -> int:
        with self._lock:
            return self._send(method, args, kwargs)

    def post(self, method: str, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self._posted.add(self._send(method, args, kwargs))

    def answer(self, ticket: int, timeout_s: float = 10.0) -> Any:
        """Ticket ``ticket``'s result; raises what the call raised, or ShardUnavailable if the
        shard is gone or silent past ``timeout_s``."""
        if not self._lock.acquire(timeout=max(timeout_s, 0.0)):
            raise ShardUnavailable(self.shard_id, f"control socket busy past {timeout_s:g} s")
        try:
            ok, value = self._until(ticket, timeout_s)
        finally:
            self._lock.release()
        if not ok:
            raise value
        return value

    def call(self, method: str, *args: Any, timeout_s: float = 10.0, **kwargs: Any) -> Any:
        """The method's result (see :meth:`answer`)."""
        return self.answer(self.send(method, *args, **kwargs), timeout_s)

    def sync(self, timeout_s: float = 10.0) -> None:
        """Read every answer due: the shard has taken every call sent so far."""
        with self._lock:
            self._read_to(self._sent, timeout_s)

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        self._check()
        try:
            _send(self._sock, (method, args, kwargs), SEND_S)
        except OSError as exc:
            raise self._fail(f"control socket: {exc}") from None
        self._sent += 1
        return self._sent

    def _until(self, ticket: int, timeout_s: float) -> tuple[bool, Any]:
        """``ticket``'s answer, read in order with those before it (the lock held)."""
        self._read_to(ticket, timeout_s)
        try:
            return self._answers.pop(ticket)
        except KeyError:
            raise ValueError(f"ticket {ticket}'s answer was taken already") from None

    def _read_to(self, ticket: int, timeout_s: float) -> None:
        while self._read < ticket:
            self._check()
            try:
                got = self._frames.next(timeout_s)
            except (OSError, ConnectionError, EOFError, pickle.UnpicklingError) as exc:
                raise self._fail(f"control socket: {exc}") from None
            self._read += 1
            if self._read in self._posted:
                self._posted.discard(self._read)
                if not got[0]:
                    self.refused += 1
                    log.warning("shard %s refused a posted call: %s", self.shard_id, got[1])
            else:
                self._answers[self._read] = got

    def _check(self) -> None:
        if self._dead is None and os.getpid() != self._pid:
            self._dead = "a forked process never uses its parent's connection"
        if self._dead is not None:
            raise ShardUnavailable(self.shard_id, self._dead)

    def _fail(self, why: str) -> ShardUnavailable:
        self._dead = why
        self.close()
        return ShardUnavailable(self.shard_id, why)

    def close(self) -> None:
        if self._dead is None:
            self._dead = "closed"
        with contextlib.suppress(OSError):
            self._sock.close()
