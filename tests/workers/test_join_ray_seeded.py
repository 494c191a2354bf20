"""Engines seed Python's ``random`` before they join hkv's Ray (vLLM's ``--seed``, default 0),
and Ray 2.60 draws its GCS subscriber ids from that same generator (28 bytes of
``random.getrandbits``): every replica then subscribed under the same id, their error
subscribers' long polls displaced each other and spun. Measured with two idle
``vllm serve`` replicas on one ``hkv up``: 0.25 cores per engine worker and 0.7 cores in Ray's
GCS, doing nothing. ``join_ray`` gives Ray fresh entropy and hands the caller its own sequence
back.

A real ``ray.init`` (a local instance, in a child process so the suite's Ray is not touched):
what Ray drew while joining is recorded, and compared with what the seeded generator gives."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CHILD = r"""
import json, random, sys
random.seed(0)
drawn = []
real = random.getrandbits

def recording(k):
    value = real(k)
    drawn.append([k, value])
    return value

random.getrandbits = recording
from workers.attach import join_ray
join_ray("local")
random.getrandbits = real
after = random.random()
import ray
ray.shutdown()
print(json.dumps({"drawn": drawn, "after": after}))
"""


def _join_seeded() -> dict[str, Any]:
    """What Ray drew while one engine seeded with 0 joined, and its next draw after."""
    # (a short folder: Ray's socket paths under it must fit AF_UNIX's 108 bytes)
    with tempfile.TemporaryDirectory(prefix="hkv-rj-", dir="/tmp") as ray_tmp:
        env = dict(os.environ, RAY_TMPDIR=ray_tmp)
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                              timeout=300, env=env, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


def test_two_engines_seeded_alike_join_under_different_ids_and_keep_their_sequence() -> None:
    first, second = _join_seeded(), _join_seeded()
    # Ray drew ids while joining (if a Ray upgrade stops, this test says so) ...
    assert len(first["drawn"]) >= 28 and len(second["drawn"]) >= 28
    # ... and two engines seeded alike drew different ones
    assert first["drawn"] != second["drawn"]
    # each engine's own sequence goes on as if Ray had drawn nothing
    assert first["after"] == second["after"] == random.Random(0).random()
