"""Builders for the worker tests: a local Ray instance, a metadata actor, shards, prefixes.

Helpers reach test modules through the ``w`` fixture (several conftest.py files, no packages).
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from hkv_service.core.api import StateConfig
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash
from hkv_service.core.layout import Layout
from hkv_service.core.state_view import CacheState
from hkv_service.specs import default_spec
from workers.inprocess import InProcessConfig, InProcessSystem
from workers.launcher import clear_stale_ray, init_local_ray, worker_pythonpath
from workers.local import LocalMetadata
from workers.raylink import ActorMetadata, MetadataActor


def prompt(n_blocks: int, seed: int = 0, hb: int = 64) -> list[BlockHash]:
    tokens = np.random.default_rng(seed).integers(0, 50000, n_blocks * hb)
    return hash_blocks(tokens, hb, ExtraKeys("hkv-reference-v1"))


def prefix_payload(layout: Layout, n_blocks: int, seed: int = 0
                   ) -> tuple[dict[tuple[int, str], np.ndarray],
                              dict[tuple[int, str], tuple[np.ndarray, int]]]:
    """Random bytes for every block of every column along ``n_blocks`` hash blocks, and a
    complete tail at every resume point."""
    rng = np.random.default_rng(seed)
    blocks: dict[tuple[int, str], np.ndarray] = {}
    tails: dict[tuple[int, str], tuple[np.ndarray, int]] = {}
    for d in range(n_blocks):
        for c in layout.attached[d % layout.period]:
            col = layout.columns[c]
            data = rng.integers(0, 256, layout.object_bytes(c, d), dtype=np.uint8)
            if col.kind.value == "TAIL":
                tails[(d, col.name)] = (data, col.tail_tokens_at((d + 1) * layout.hash_block))
            else:
                blocks[(d, col.name)] = data
    return blocks, tails


class CountingPort:
    """A metadata port that counts the calls made through it, by method name."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)
        return counted


class Helpers:
    CountingPort = CountingPort
    prompt = staticmethod(prompt)
    prefix_payload = staticmethod(prefix_payload)
    clear_stale_ray = staticmethod(clear_stale_ray)

    @staticmethod
    def metadata(**config: Any) -> ActorMetadata:
        actor = MetadataActor.remote(default_spec(), StateConfig(**config))
        return ActorMetadata(actor)


@pytest.fixture(scope="session")
def w() -> type[Helpers]:
    return Helpers


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    clear_stale_ray()
    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"PYTHONPATH": worker_pythonpath()}})
    yield
    ray.shutdown()


@pytest.fixture
def meta() -> LocalMetadata:
    """A fresh state view of the reference spec behind the in-process port."""
    return LocalMetadata(CacheState(default_spec(), StateConfig()))


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "hkv-data"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def inprocess(tmp_path: Path) -> Iterator[Callable[..., InProcessSystem]]:
    """``inprocess(shards=1, ...)``: an InProcessSystem of the reference spec (closed after)."""
    made: list[InProcessSystem] = []

    def make(**config: Any) -> InProcessSystem:
        s = InProcessSystem(default_spec(), tmp_path / f"sys{len(made)}", InProcessConfig(**config))
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()
