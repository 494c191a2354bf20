"""The write claims of a worker on a shard's node, over a local socket instead of Ray.

A write through the shared segment (:mod:`workers.shared`) takes two calls to the shard,
``claim_blocks`` and ``finish_blocks``; through Ray each costs ~1 ms here, more than copying a
few MiB. The shard serves those two (and ``release_blocks``) on a Unix socket in the abstract
namespace (no file to leave behind; gone with the process), named with the segment's nonce;
a round trip costs tens of microseconds. Only processes of the shard's own user are served
(``SO_PEERCRED``), only these three methods, each under the shard's lock as a Ray call is.

Frames: 8-byte little-endian length, then a pickle of ``(method, args, kwargs)``; the answer is
``(True, result)`` or ``(False, exception)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import struct
import threading
from typing import Any

from .link import ShardUnavailable

__all__ = ["SERVED", "ControlClient", "ControlServer"]

log = logging.getLogger(__name__)

SERVED = frozenset({"claim_blocks", "finish_blocks", "release_blocks"})
_LEN = struct.Struct("<Q")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    head = _exact(sock, _LEN.size)
    return pickle.loads(_exact(sock, _LEN.unpack(head)[0]))


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the socket")
        buf += chunk
    return bytes(buf)


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
        while not self._closed.is_set():
            try:
                method, args, kwargs = _recv(conn)
            except (OSError, ConnectionError, EOFError):
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
    """One connection to a shard's :class:`ControlServer`; one call at a time."""

    def __init__(self, shard_id: str, name: str, timeout_s: float = 10.0) -> None:
        self.shard_id = shard_id
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect("\0" + name)
        except OSError:
            self._sock.close()
            raise
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, timeout_s: float = 10.0, **kwargs: Any) -> Any:
        """The method's result; raises what it raised, or ShardUnavailable if the shard is
        gone or silent past ``timeout_s``."""
        with self._lock:
            try:
                self._sock.settimeout(timeout_s)
                _send(self._sock, (method, args, kwargs))
                ok, value = _recv(self._sock)
            except (OSError, ConnectionError, EOFError) as exc:
                self.close()
                raise ShardUnavailable(self.shard_id, f"control socket: {exc}") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
