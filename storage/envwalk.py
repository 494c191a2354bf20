"""The child's side of :mod:`storage.envprobe`: walk an LMDB environment with LMDB itself.

Run as ``python -I -S envwalk.py LMDB_DIR ENV_DIR``: isolated, without ``site`` (no start-up
cost, nothing on the path but the standard library and the folder the parent imported lmdb
from). It imports no hkv module. It opens the environment read-only, walks every tree (every
key and value, as the open's own walk does) and looks each key up (the search paths the tier's
audit and reads take). Output: ``walking`` once lmdb is imported, then one JSON line: ``{}``,
``{"damage": ...}`` for a key the walk meets that its lookup misses (a key out of order in its
page), or ``{"error": <lmdb exception class>, "text": ...}``. A crash ends this process only.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # the child: lmdb from where the parent imported it
    sys.path.insert(0, sys.argv[1])

import lmdb

__all__ = ["MAX_DBS", "STARTED", "main"]

STARTED = "walking"
MAX_DBS = 64  # far more than any layout of ours names; more is a page of garbage


class Damage(Exception):
    """What the walk itself finds wrong: a key the cursor walks that a lookup of it does not
    find (out of order in its page: a bit flipped in it; deletes by key miss it, and may miss
    the keys near it), or more names in the main database than any layout of ours has."""


def walk_all(path: str) -> None:
    """Open ``path`` read-only, walk every tree and look every key up. Raises lmdb.Error (LMDB
    met damage) or Damage."""
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    # Map the file's size (LMDB raises it to the pages in use), never the meta page's claim,
    # which may be garbage.
    env = lmdb.open(path, readonly=True, max_dbs=MAX_DBS, map_size=max(size, 1 << 20),
                    subdir=True, lock=True)
    try:
        with env.begin(buffers=True) as txn:
            names = [bytes(key) for key in _walk(txn, None)]
            if len(names) >= MAX_DBS:
                raise Damage(f"{len(names)} names in the main database")
            for name in names:
                _walk(txn, env.open_db(name, txn=txn, create=False))
    finally:
        env.close()


def _walk(txn: lmdb.Transaction, db: object) -> list[bytes]:
    """Every key of ``db`` in order (its value taken, as the open's walk takes it), each
    looked up by key as it is met; returns the keys of the main database (``db`` None)."""
    keys = []
    with txn.cursor(db=db) as cur:  # type: ignore[arg-type]
        for key, _value in cur.iternext(keys=True, values=True):
            if txn.get(key, db=db) is None:  # type: ignore[call-overload]
                raise Damage(f"a key of {len(key)} bytes that the tree walk meets but a "
                                   "lookup of it does not find (out of order in its page)")
            if db is None:
                keys.append(bytes(key))
    return keys


def main(argv: list[str]) -> int:
    print(STARTED, flush=True)
    try:
        walk_all(argv[2])
    except Damage as exc:
        print(json.dumps({"damage": str(exc)}), flush=True)
    except lmdb.Error as exc:
        print(json.dumps({"error": type(exc).__name__, "text": str(exc)[:300]}), flush=True)
    else:
        print(json.dumps({}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
