"""A recurrent state is filed under a boundary only if it is that boundary's, in the spec's
parts, shapes and dtypes (workers.checkpoints, issue 37)."""

from __future__ import annotations

import numpy as np
import pytest

from hkv_service.core.layout import Layout
from hkv_service.specs import demo_spec
from workers.checkpoints import StateCheckpoint, StateRefused, state_payload

LAY = Layout(demo_spec())  # hash blocks of 64, resume points every 128 tokens
CONV = np.arange(96, dtype=np.float32).reshape(3, 32)
SSM = np.arange(256, dtype=np.float32).reshape(16, 16) / 7


def test_the_boundary_state_is_its_parts_in_order() -> None:
    out = state_payload(LAY, "gla", 3, StateCheckpoint((CONV, SSM), 256))
    assert out.dtype == np.uint8 and out.nbytes == LAY.columns[LAY.by_name["gla"]].nbytes
    assert out.tobytes() == CONV.tobytes() + SSM.tobytes()


@pytest.mark.parametrize(("depth", "ckpt", "why"), [
    (3, StateCheckpoint((CONV, SSM), 128), "as of token 128 is not the state at the boundary 256"),
    (3, StateCheckpoint((CONV, SSM), 384), "as of token 384 is not the state at the boundary 256"),
    (2, StateCheckpoint((CONV, SSM), 192), "not a resume point"),
    (3, StateCheckpoint((CONV.astype(np.float16), SSM), 256), "part #0 is float16"),
    (3, StateCheckpoint((CONV, SSM.astype(np.float64)), 256), "part #1 is float64"),
    (3, StateCheckpoint((CONV, SSM.T[:8]), 256), r"part #1 is float32 \(8, 16\)"),
    (3, StateCheckpoint((SSM,), 256), "1 state parts, the spec names 2"),
])
def test_any_other_state_is_refused(depth: int, ckpt: StateCheckpoint, why: str) -> None:
    with pytest.raises(StateRefused, match=why):
        state_payload(LAY, "gla", depth, ckpt)


def test_only_a_state_column_takes_a_state() -> None:
    for name in ("c4", "c4.tail", "nope"):
        with pytest.raises(StateRefused, match="not a recurrent group's state column"):
            state_payload(LAY, name, 3, StateCheckpoint((CONV, SSM), 256))
