"""Builders shared by tests and benchmarks: pools for a layout, and a prefix written to READY.

Not used by the service itself. Writing "to READY" here only moves metadata (no bytes): it is
the sequence of transitions a real writer reports after its bytes landed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from .core.api import AllocRequest, Params, PoolConfig
from .core.hashing import ExtraKeys, hash_blocks
from .core.ids import BlockHash, ObjectId, ShardId
from .core.layout import Layout
from .core.spec import CacheSpec
from .core.state_view import CacheState
from .core.states import Event, Kind

__all__ = ["commit_prefix", "pools_for", "prompt_hashes"]


def pools_for(layout: Layout, num_blocks: int, base_align: int = 4096) -> dict[str, PoolConfig]:
    return {
        c.name: PoolConfig(num_blocks, max(256, -(-c.nbytes // 256) * 256), base_align)
        for c in layout.columns
    }


def commit_prefix(
    state: CacheState,
    hashes: Sequence[BlockHash],
    owner: ShardId | None = None,
    skip: frozenset[tuple[int, str]] = frozenset(),
    first_block: int = 0,
) -> dict[tuple[int, str], ObjectId]:
    """Allocate and commit every object of every column along ``hashes`` (except ``skip``),
    the hashes of blocks ``first_block`` on (a range of a split chain)."""
    lay = state.layout
    reqs = [
        AllocRequest(d, lay.columns[c].name)
        for d in range(first_block, first_block + len(hashes))
        for c in lay.attached[d % lay.period]
        if (d, lay.columns[c].name) not in skip
    ]
    allocs = state.allocate(hashes, reqs, owner, first_block)
    ids = {(r.depth, r.column): a.handle.object_id for r, a in zip(reqs, allocs, strict=True)}
    versions: dict[tuple[int, str], int] = {}
    for r, a in zip(reqs, allocs, strict=True):
        if a.existing:
            continue
        kind = a.handle.kind
        if kind is Kind.TAIL:
            need = lay.tail_tokens(a.handle.column, r.depth)
            state.transition(a.handle.object_id, Event.TAIL_DONE, Params(tail_len=need))
        elif kind is not Kind.INDEXER:
            res = state.transition(a.handle.object_id, Event.WRITE_DONE)
            versions[(r.depth, r.column)] = res.version
    for r, a in zip(reqs, allocs, strict=True):
        if a.handle.kind is Kind.INDEXER and not a.existing:
            kv = lay.columns[lay.columns[a.handle.column].indexes or 0].name
            state.transition(a.handle.object_id, Event.WRITE_DONE)
            version = versions.get((r.depth, kv))
            if version is not None:
                state.transition(a.handle.object_id, Event.INDEXER_SYNC, Params(version=version))
    return ids


def question(doc: Sequence[BlockHash], seed: int, n_blocks: int) -> list[BlockHash]:
    """A new question over the document ``doc``: its hashes, then ``n_blocks`` the cache
    never held (distinct for each ``seed``)."""
    return [*doc, *(BlockHash(xxhash.xxh3_128_digest(b"question %d.%d" % (seed, j)))
                    for j in range(n_blocks))]


def prompt_hashes(spec: CacheSpec, n_blocks: int, seed: int = 0) -> list[BlockHash]:
    """Chained hashes of a random prompt of ``n_blocks`` whole hash blocks."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 50_000, n_blocks * spec.hash_block_size)
    return hash_blocks(toks, spec.hash_block_size, ExtraKeys(spec.model_id))
