"""Recurrent state checkpoints (Kind.STATE) as a writer hands them over, and the check that
files one under a boundary only if it is that boundary's state, in the spec's dtypes and shapes.

A recurrent layer's state summarises every token before it; a state as of another position
or held in another dtype imports without an error and only changes the logits (issue 37). So a
writer hands each state with the position it is as of (vLLM's ``boundary_state_offloads`` says
``boundary_tokens``; the reference model's cache knows its length) and its parts as typed
arrays, and :func:`state_payload` refuses it unless

* its column is a RECURRENT group's and the slot is a resume point (a multiple of the LCM),
* it is as of exactly the slot's boundary, ``(depth + 1) * hash_block`` tokens, and
* its parts are, in order, the shapes and dtypes the spec's group names (its ABI).

A refused state is not written: the boundary has no state, and a reader resumes at an earlier
one where every recurrent group has its own (``NO_STATE_AT_BOUNDARY``), or recomputes. What
this cannot see is a writer that states a wrong position for a state; the position comes from
the engine's hand-off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hkv_service.core.layout import Layout
from hkv_service.core.states import Kind

__all__ = ["StateCheckpoint", "StateRefused", "state_payload"]


@dataclass(frozen=True)
class StateCheckpoint:
    """One recurrent group's state: its parts (stored order, as the writer holds them) and the
    number of tokens it is the state after."""

    parts: Sequence[np.ndarray]
    position: int


class StateRefused(ValueError):
    """A state that is not the slot's boundary's state in the spec's layout: not written."""


def state_payload(layout: Layout, column: str, depth: int, ckpt: StateCheckpoint) -> np.ndarray:
    """The bytes to write for ``ckpt`` at ``(depth, column)``; StateRefused says why not."""
    index = layout.by_name.get(column)
    col = layout.columns[index] if index is not None else None
    if col is None or col.kind is not Kind.STATE:
        raise StateRefused(f"{column!r} is not a recurrent group's state column")
    boundary = (depth + 1) * layout.hash_block
    if boundary % layout.lcm:
        raise StateRefused(f"depth {depth} ends at token {boundary}, not a resume point "
                           f"(a multiple of {layout.lcm}): no state lives there")
    if ckpt.position != boundary:
        raise StateRefused(f"{column!r}: a state as of token {ckpt.position} is not the state "
                           f"at the boundary {boundary} it would be filed under")
    want = col.group.state
    if len(ckpt.parts) != len(want):
        raise StateRefused(f"{column!r}: {len(ckpt.parts)} state parts, the spec names "
                           f"{len(want)}")
    for i, (arr, part) in enumerate(zip(ckpt.parts, want, strict=True)):
        if arr.dtype.name != part.dtype or tuple(arr.shape) != part.shape:
            raise StateRefused(f"{column!r}: state part #{i} is {arr.dtype.name} "
                               f"{tuple(arr.shape)}, the spec's ABI says {part.dtype} "
                               f"{part.shape}")
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1)
                           for a in ckpt.parts])
