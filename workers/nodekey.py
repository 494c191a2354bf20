"""The name of a node's disk tiers: what its shards' directories under ``--data-dir`` are
called, the same on every run.

A shard keeps its disk tier in ``DATA_DIR/shard-<key>-<k>``. The key must be the one the
node's tiers already have, or a restarted ``hkv up`` opens empty directories: the tiers it
kept are lost (and left on disk, outside any budget). Ray's node id is new on every run; a
host name is shared by the Ray nodes of one machine (tests) and changes where a Kubernetes pod
is rescheduled while a head's PVC persists. So the tiers name themselves: the launcher asks
each node which keys its data dir holds (:func:`tier_keys`, a Ray task pinned there) and gives
each node one (:func:`assign_keys`): the most recently written key found there that no other
node holds, else a new random one, whose directories its shards then make. The name lives and
dies with the volume, which is the tier's life; a data dir emptied (``hkv demo`` removes its
tiers) holds nothing else.

Ray nodes sharing one data dir (several nodes on one machine) find the same keys and divide
them; a tier left by a run of an older hkv (named after a Ray node id) is adopted the same way.

Stdlib only: :func:`tier_keys` runs in a fresh Ray worker, where importing it is cheap.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["assign_keys", "new_key", "tier_keys"]

TIER_DIR = re.compile(r"shard-(?P<key>[A-Za-z0-9_.]{1,32})-(?P<index>\d+)")


def tier_keys(data_dir: str) -> list[str]:
    """The keys of the shard directories in ``data_dir``, the most recently written first
    (its LMDB data file's time; the directory's where it has none); none if it is missing."""
    written: dict[str, float] = {}
    try:
        entries = list(Path(data_dir).iterdir())
    except FileNotFoundError:
        return []
    for path in entries:
        m = TIER_DIR.fullmatch(path.name)
        if m and path.is_dir():
            key = m["key"]
            written[key] = max(written.get(key, 0.0), _written(path))
    return sorted(written, key=lambda k: (-written[k], k))


def _written(tier: Path) -> float:
    for path in (tier / "data.mdb", tier):
        try:
            return path.stat().st_mtime
        except OSError:
            continue
    return 0.0


def new_key() -> str:
    return uuid.uuid4().hex[:8]


def assign_keys(found: Iterable[tuple[str, Sequence[str]]], taken: Iterable[str] = ()
                ) -> dict[str, str]:
    """``(node id, keys its data dir holds)`` pairs -> node id -> its key: the first found
    there that no node holds yet, else a new one. ``taken``: keys of nodes placed earlier."""
    used = set(taken)
    out: dict[str, str] = {}
    for node, keys in found:
        key = next((k for k in keys if k not in used), None)
        while key is None or key in used:
            key = new_key()
        used.add(key)
        out[node] = key
    return out
