"""A shard that starts while the metadata service restarts (Ray restarting a killed shard
actor as the service goes down and comes back) waits for the service instead of failing its
constructor: Ray never restarts an actor whose constructor failed, so the shard was lost for
good (a fresh-clone CI: the demo's shard_kill and service_restart faults met, the shard's
``__init__`` died on "Unavailable: Stream removed (Connection reset by peer)" and the demo
waited 180 s for a rejoin that could not come)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

import workers.shard as shard_mod
from hkv_service.core.errors import Unavailable
from workers.inprocess import InProcessSystem
from workers.shard import REGISTRATIONS, ShardActor


class _Unreachable:
    """The system's metadata port, whose first ``fails`` registrations cannot reach it."""

    def __init__(self, port: Any, fails: int) -> None:
        self._port, self.fails, self.calls = port, fails, 0

    def register_owner(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.fails:
            raise Unavailable("Stream removed (recvmsg:Connection reset by peer (104))")
        return self._port.register_owner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._port, name)


def test_a_shard_starting_while_the_service_is_unreachable_registers_once_it_is_back(
        inprocess: Any) -> None:
    system: InProcessSystem = inprocess(shards=1, blocks_per_group=8)
    port = _Unreachable(system.meta, fails=3)
    shard = ShardActor(replace(system.shard_config("shard-9"), metadata=port))
    try:
        assert port.calls == 4
        assert shard.stats()["counts"].get(REGISTRATIONS) == 1
        system.meta.heartbeat("shard-9", shard.incarnation)  # (UnknownOwner if not registered)
    finally:
        shard.shutdown()


def test_a_service_unreachable_past_the_wait_fails_the_shards_start_with_its_error(
        inprocess: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_mod, "REGISTER_UNREACHABLE_S", 0.5)
    system: InProcessSystem = inprocess(shards=1, blocks_per_group=8)
    port = _Unreachable(system.meta, fails=10_000)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="Connection reset"):
        ShardActor(replace(system.shard_config("shard-9"), metadata=port))
    assert time.monotonic() - t0 < 5 and port.calls >= 2
