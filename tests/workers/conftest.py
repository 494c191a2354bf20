"""Builders for the worker tests: a local Ray instance, a metadata actor, shards, prefixes.

Helpers reach test modules through the ``w`` fixture (several conftest.py files, no packages).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
# tests/storage (no __init__.py) shadows the real ``storage`` package as a namespace package
# when pytest puts tests/ on sys.path; the repository root must come first.
if str(_ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(_ROOT))
if getattr(sys.modules.get("storage"), "__file__", "") is None:
    for _name in [m for m in sys.modules if m == "storage" or m.startswith("storage.")]:
        del sys.modules[_name]

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402

from hkv_service.core.hashing import ExtraKeys, hash_blocks  # noqa: E402
from hkv_service.core.ids import BlockHash  # noqa: E402
from hkv_service.core.layout import Layout  # noqa: E402
from hkv_service.core.state_view import StateConfig  # noqa: E402
from hkv_service.specs import default_spec  # noqa: E402
from workers.launcher import init_local_ray  # noqa: E402
from workers.local import ActorMetadata, MetadataActor  # noqa: E402

RAY_CURRENT = Path("/tmp/ray/ray_current_cluster")


def clear_stale_ray() -> None:
    if RAY_CURRENT.exists():
        RAY_CURRENT.unlink(missing_ok=True)


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
            data = rng.integers(0, 256, col.nbytes, dtype=np.uint8)
            if col.kind.value == "TAIL":
                tails[(d, col.name)] = (data, col.tail_tokens_at((d + 1) * layout.hash_block))
            else:
                blocks[(d, col.name)] = data
    return blocks, tails


class Helpers:
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
                   runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_pythonpath())}})
    yield
    ray.shutdown()


def _pythonpath() -> list[str]:
    return [str(_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "hkv-data"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
