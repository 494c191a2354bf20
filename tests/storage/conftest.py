"""Shared builders for the disk-tier tests: keys, realistic KV payloads, tiers, bit flips.

Test modules reach the helpers through the ``h`` fixture rather than ``from conftest import``:
with several ``conftest.py`` files and no packages, that module name is ambiguous.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import storage
from hkv_service.core.api import AdmissionCap
from storage import DiskKey, DiskTier

KINDS = ("COMPRESSED", "TAIL", "SWA", "INDEXER")
REPO_ROOT = Path(storage.__file__).resolve().parent.parent


def make_key(i: int, kind: str = "SWA", group: str = "g0", abi: int = 7) -> DiskKey:
    return DiskKey(i.to_bytes(16, "big"), group, kind, abi)


def kv_bytes(nbytes: int, seed: int = 0) -> bytes:
    """Realistic KV bytes: random-normal fp16 (barely compressible)."""
    values = np.random.default_rng(seed).standard_normal(nbytes // 2).astype(np.float16)
    return values.tobytes() + b"\x01" * (nbytes % 2)


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def find_once(path: Path, pattern: bytes) -> int:
    data = path.read_bytes()
    assert data.count(pattern) == 1, "pattern must occur exactly once in the file"
    return data.index(pattern)


def run_child(script: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run a small Python script in a fresh interpreter that can import the project."""
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True,
        timeout=timeout, env=child_env(), check=False,
    )


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


class Helpers:
    kinds = KINDS
    repo_root = REPO_ROOT
    make_key = staticmethod(make_key)
    kv_bytes = staticmethod(kv_bytes)
    flip_bit = staticmethod(flip_bit)
    find_once = staticmethod(find_once)
    run_child = staticmethod(run_child)
    child_env = staticmethod(child_env)


@pytest.fixture
def h() -> type[Helpers]:
    return Helpers


@pytest.fixture
def tier_factory(tmp_path: Path) -> Iterator[Callable[..., DiskTier]]:
    opened: list[DiskTier] = []

    def make(budget: int = 64 << 20, cap: AdmissionCap | None = None, **kw: Any) -> DiskTier:
        tier = DiskTier(tmp_path / "disk", budget, cap or AdmissionCap(), **kw)
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()  # idempotent: fine if the test closed it already


@pytest.fixture
def tier(tier_factory: Callable[..., DiskTier]) -> DiskTier:
    return tier_factory()
