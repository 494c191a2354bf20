"""Registration is bounded: a pool's per-block metadata grows with the blocks used, not the
blocks declared, and the owner table has a bound with a clear RESOURCE_EXHAUSTED past it.

Regression (issue 17, item 6): one 22-byte RegisterOwner declaring a pool of 4,194,304
blocks grew ``hkv serve`` by ~230 MiB, and every new owner name added more."""

from __future__ import annotations

from pathlib import Path

import pytest
from svc_util import Proc, commit_remote, default_spec_layout, hashes, start_serve

from hkv_service.client import MetadataClient
from hkv_service.core import errors as E
from hkv_service.core.api import LookupRequest, PoolConfig, StateConfig
from hkv_service.core.state_view import CacheState
from hkv_service.specs import default_spec
from hkv_service.testing import pools_for

HUGE = 4_194_304


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_huge_declared_pool_costs_nothing_until_used(procs: list[Proc]) -> None:
    p = start_serve("--port", "0")
    procs.append(p)
    with MetadataClient(f"127.0.0.1:{p.port}") as c:
        c.register_owner("warm", pools_for(default_spec_layout(), 8))  # first-call costs
        before = _rss_kib(p.popen.pid)
        for i in range(4):
            c.register_owner(f"huge{i}", pools_for(default_spec_layout(), HUGE))
        grown_mib = (_rss_kib(p.popen.pid) - before) / 1024
        assert grown_mib < 16, f"4 x 5 pools of {HUGE} blocks grew the server {grown_mib} MiB"
        ids = commit_remote(c, hashes(4), owner="huge0")  # and such a pool works
        assert len(ids) > 0
        assert c.lookup(LookupRequest(hashes(4))).usable_tokens == 256
        with pytest.raises(E.InvalidInput, match="num_blocks"):
            c.register_owner("over", {"c4": PoolConfig(1 << 30, 2048, 4096)})
    assert p.stop() == 0


def test_the_owner_table_is_bounded_and_lost_owners_make_room() -> None:
    st = CacheState(default_spec(), StateConfig(max_owners=3))
    pools = pools_for(st.layout, 4)
    for name in ("a", "b", "c"):
        st.register_owner(name, pools)  # type: ignore[arg-type]
    with pytest.raises(E.ResourceExhausted, match="max_owners"):
        st.register_owner("d", pools)  # type: ignore[arg-type]
    st.register_owner("a", pools)  # type: ignore[arg-type]  # a known name comes back: fine
    st.mark_owner_lost("b")  # type: ignore[arg-type]
    st.register_owner("d", pools)  # type: ignore[arg-type]  # b's place, it holds nothing
    assert set(st.owners) == {"a", "c", "d"}


def test_the_generation_floor_crosses_the_wire(procs: list[Proc]) -> None:
    """A shard's ``generation_floor`` reaches the service (RegisterOwner) and its blocks go out
    at it (workers/generations.py: a claim from before a restart stays below it); a floor
    past 2**62 is refused."""
    from dataclasses import replace

    from hkv_service.core.api import AllocRequest

    p = start_serve("--port", "0")
    procs.append(p)
    floor = (1 << 40) + 7
    with MetadataClient(f"127.0.0.1:{p.port}") as c:
        pools = pools_for(default_spec_layout(), 8)
        c.register_owner("s", {n: replace(cfg, generation_floor=floor) for n, cfg in pools.items()})
        (a,) = c.allocate(hashes(1), [AllocRequest(0, "c4")])
        assert a.handle.generation == floor
        with pytest.raises(E.InvalidInput, match="generation_floor"):
            c.register_owner("t", {"c4": PoolConfig(8, 2048, 4096, generation_floor=1 << 62)})
    assert p.stop() == 0
