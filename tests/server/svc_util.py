"""Helpers for server tests: an in-process server, a remote commit helper, and a ``hkv serve``
subprocess that is always stopped by pid."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hkv_service.client import MetadataClient, TransitionItem
from hkv_service.core.api import AllocRequest, Params
from hkv_service.core.ids import BlockHash, ObjectId, ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind
from hkv_service.server.app import ServerConfig, Service, build_service
from hkv_service.specs import default_spec
from hkv_service.testing import pools_for, prompt_hashes

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Live:
    service: Service
    state: CacheState
    port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_live(config: ServerConfig | None = None, state: CacheState | None = None) -> Live:
    state = state or CacheState(default_spec())
    service = build_service(config or ServerConfig(port=0), state)
    service.server.start()
    return Live(service, state, service.port)


def register(client: MetadataClient, owner: str = "s0", blocks: int = 256) -> int:
    return client.register_owner(owner, pools_for(default_spec_layout(), blocks))


@functools.cache
def default_spec_layout() -> Layout:
    return Layout(default_spec())


def hashes(n: int, seed: int = 0) -> list[BlockHash]:
    return prompt_hashes(default_spec(), n, seed)


def commit_remote(client: MetadataClient, hs: Sequence[BlockHash],
                  owner: str | None = None) -> dict[tuple[int, str], ObjectId]:
    """``testing.commit_prefix`` through the gRPC client: allocate, write, sync indexers."""
    lay = default_spec_layout()
    reqs = [AllocRequest(d, lay.columns[c].name)
            for d in range(len(hs)) for c in lay.attached[d % lay.period]]
    allocs = client.allocate(hs, reqs, owner)
    first: list[TransitionItem] = []
    for r, a in zip(reqs, allocs, strict=True):
        if a.existing:
            continue
        if a.handle.kind is Kind.TAIL:
            need = lay.columns[a.handle.column].tail_tokens_at((r.depth + 1) * lay.hash_block)
            first.append(TransitionItem(a.handle.object_id, Event.TAIL_DONE,
                                        Params(tail_len=need)))
        else:
            first.append(TransitionItem(a.handle.object_id, Event.WRITE_DONE))
    results = client.transition_many(first)
    versions = {}
    for item, res in zip(first, results, strict=True):
        assert not isinstance(res, Exception), res
        versions[item.object_id] = res.version
    ids = {(r.depth, r.column): a.handle.object_id for r, a in zip(reqs, allocs, strict=True)}
    sync = []
    for r, a in zip(reqs, allocs, strict=True):
        if a.handle.kind is Kind.INDEXER and not a.existing:
            kv = lay.columns[lay.columns[a.handle.column].indexes or 0].name
            sync.append(TransitionItem(a.handle.object_id, Event.INDEXER_SYNC,
                                       Params(version=versions[ids[(r.depth, kv)]])))
    for res in client.transition_many(sync):
        assert not isinstance(res, Exception), res
    return ids


# ---- subprocess server ------------------------------------------------------------------------

@dataclass
class Proc:
    popen: subprocess.Popen[str]
    port: int

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.popen.pid, signal.SIGKILL)
            return self.popen.wait(5)


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hkv_service.cli", "serve", *args]


def start_serve(*args: str, timeout: float = 30.0) -> Proc:
    """Run ``hkv serve ARGS`` and wait for its 'listening on' line."""
    popen = subprocess.Popen(serve_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT)
    deadline = time.monotonic() + timeout
    assert popen.stdout is not None
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if "listening on" in line:
            return Proc(popen, int(line.rsplit(":", 1)[1]))
        if not line and popen.poll() is not None:
            err = popen.stderr.read() if popen.stderr else ""
            raise AssertionError(f"hkv serve exited {popen.returncode}: {err}")
    os.kill(popen.pid, signal.SIGKILL)
    popen.wait()
    raise AssertionError("hkv serve did not print 'listening on' in time")


__all__ = ["Live", "Proc", "ShardId", "commit_remote", "hashes", "register", "start_live",
           "start_serve"]
