"""What moves between hkv and vLLM's paged KV for one request: load and save plans.

Pure (no vLLM, no I/O): the scheduler side builds these from a funnel answer and vLLM's block
ids; the worker side carries them out. Index ranges of one request, tokens::

    [0, local)          vLLM's own prefix-cache hit: never loaded, never overwritten
    [local, target)     loaded from hkv: target = local + the tokens vLLM took from hkv
    [0, computed)       tokens whose KV the finished request holds; whole blocks are saved,
                        except those ending at or before ``known`` (hkv had them already)

A group's block ``k`` covers ``[k*bs, (k+1)*bs)``; ``local`` and ``target`` are multiples of
every block size (hkv's LCM block), so no block straddles either.

A recurrent group is not positional: its object is the state after exactly ``p`` tokens.
It is saved only from vLLM's hand-offs (``boundary_state_offloads``: group ``g``'s block
``b`` holds the state at ``p`` once this step's forward ran), never from the block table
(align-mode tables are not append-only), and loaded for a hit at ``target`` into the one
block vLLM planned for it: index ``target // bs - 1`` (nulls before it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hkv_service.core.api import Match
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash
from hkv_service.core.layout import Layout

from .geometry import Geometry

__all__ = ["LoadCopy", "LoadJob", "SaveItem", "SaveJob", "load_copies", "save_items",
           "state_items"]


@dataclass(frozen=True, slots=True)
class LoadCopy:
    """Handle ``index`` of ``column`` in the match goes into vLLM block ``block_id``."""

    column: str
    index: int
    group: int  # vLLM KV-cache group
    block_id: int


@dataclass(frozen=True, slots=True)
class SaveItem:
    """vLLM block ``block_id`` of ``group`` is the object of ``column`` at ``depth``."""

    depth: int
    column: str
    group: int
    block_id: int


@dataclass(frozen=True, slots=True)
class LoadJob:
    """One request's load. ``match`` is None when the leased lookup already fell short of what
    vLLM scheduled (``reason`` says why): the worker then reports it failed, reading nothing.
    ``error_blocks`` are block ids reported as load errors whatever the read gives (the tokens
    a shorter leased answer no longer covers, single full-attention group only)."""

    req_id: str
    hashes: tuple[BlockHash, ...]
    match: Match | None
    copies: tuple[LoadCopy, ...]
    tokens: int  # tokens the copies restore beyond vLLM's local hit
    reason: str = ""
    error_blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Blocks of one request to write to hkv. ``held``: vLLM keeps them for this save (the
    request finished) until the worker reports it done; otherwise the request is running.
    ``token_ids``: the tokens of the prefix's whole hash blocks (int32 LE); the save lane
    hashes them (off the step) and sends them with the allocate (the KV events carry them)."""

    req_id: str
    items: tuple[SaveItem, ...]
    token_ids: bytes
    extra: ExtraKeys
    held: bool = False

    def hashes(self, hash_block: int) -> list[BlockHash]:
        return hash_blocks(np.frombuffer(self.token_ids, "<i4"), hash_block, self.extra)


def load_copies(geo: Geometry, layout: Layout, match: Match, local: int, target: int,
                block_ids: Sequence[Sequence[int]], null_block: int
                ) -> tuple[LoadCopy, ...] | str:
    """The copies that restore ``[local, target)`` from ``match`` (a lookup resumed at
    ``target``), or a sentence why they cannot: vLLM holds a block there that hkv did not
    hand out (the load must then fail: vLLM would read that block's stale bytes)."""
    out: list[LoadCopy] = []
    for g in geo.groups:
        col = layout.by_name[g.name]
        ids = block_ids[g.vllm_group]
        handles = match.handles.get(g.name, ())
        depths = layout.needed_depths(col, target)
        if len(handles) != len(depths):
            return f"{g.name}: {len(handles)} handles for {len(depths)} needed blocks"
        have = set()
        for i, depth in enumerate(depths):
            k = geo.block_of(g, depth)
            if k * g.block_size < local:
                continue
            if k >= len(ids):
                return f"{g.name}: vLLM holds {len(ids)} blocks, block {k} is needed"
            if g.recurrent and ids[k] == null_block:  # the state would be read from nowhere
                return f"{g.name}: vLLM planned no block for the state at {target}"
            if ids[k] != null_block:
                out.append(LoadCopy(g.name, i, g.vllm_group, ids[k]))
                have.add(k)
        for k in range(local // g.block_size, min(target // g.block_size, len(ids))):
            if ids[k] != null_block and k not in have:
                return f"{g.name}: vLLM block {k} ([{k * g.block_size}, "\
                       f"{(k + 1) * g.block_size})) has no hkv object"
    return tuple(out)


def save_items(geo: Geometry, block_ids: Sequence[Sequence[int]], computed: int, known: int,
               null_block: int) -> tuple[SaveItem, ...]:
    """Every whole block of ``[0, computed)`` vLLM still holds, past ``known`` (attention
    groups only: a recurrent group's blocks come from hand-offs, :func:`state_items`)."""
    out = []
    for g in geo.groups:
        if g.recurrent:
            continue
        for k, block_id in enumerate(block_ids[g.vllm_group]):
            end = (k + 1) * g.block_size
            if end > computed:
                break
            if end > known and block_id != null_block:
                out.append(SaveItem(geo.depth_of(g, k), g.name, g.vllm_group, block_id))
    return tuple(out)


def state_items(geo: Geometry, handoffs: Sequence[tuple[int, int, int]], start: int, end: int,
                null_block: int) -> tuple[tuple[SaveItem, ...], int]:
    """The state objects in a request's hand-offs of one step (``(vLLM group, block id,
    boundary tokens)``) whose state this step's forward computes (``start < boundary <=
    end``), and how many hand-offs were dropped: a boundary this step does not compute, no
    resume point of hkv's (not a multiple of the LCM block), the null block, or a group that
    is not recurrent. vLLM hands off again a block whose state a request resumed from (its
    own cache's, or hkv's: at ``boundary == start``); that block holds what was loaded, or,
    had the load failed, whatever it held before: never saved."""
    by_group = {g.vllm_group: g for g in geo.groups if g.recurrent}
    out, dropped = [], 0
    for group, block_id, boundary in handoffs:
        g = by_group.get(group)
        if (g is None or block_id == null_block or boundary <= start or boundary > end
                or boundary % geo.lcm):
            dropped += 1
            continue
        out.append(SaveItem(boundary // geo.hash_block_size - 1, g.name, group, block_id))
    return tuple(out), dropped
