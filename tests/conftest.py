"""Shared fixtures: the reference spec, a fresh state view with one registered shard."""

from __future__ import annotations

import pytest

from hkv_service.core.api import StateConfig
from hkv_service.core.ids import ShardId
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.specs import default_spec
from hkv_service.testing import pools_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="session")
def spec() -> CacheSpec:
    return default_spec()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(spec: CacheSpec, clock: FakeClock) -> CacheState:
    st = CacheState(spec, StateConfig(), clock=clock)
    st.register_owner(ShardId("s0"), pools_for(st.layout, 128))
    return st
