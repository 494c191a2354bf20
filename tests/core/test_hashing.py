from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hkv_service.core.errors import InvalidInput
from hkv_service.core.hashing import ExtraKeys, hash_blocks, naive_hash_blocks

E = ExtraKeys("m")


@given(st.lists(st.integers(0, 2**31 - 1), max_size=300), st.integers(1, 40))
def test_matches_the_textbook_loop_and_is_prefix_stable(tokens, block) -> None:
    hs = hash_blocks(tokens, block, E)
    assert hs == naive_hash_blocks(tokens, block, E)
    assert len(hs) == len(tokens) // block  # a partial block has no hash
    cut = (len(tokens) // 2) // block * block
    assert hash_blocks(tokens[:cut], block, E) == hs[: cut // block]


def test_chaining_and_extra_keys() -> None:
    t = np.arange(256)
    base = hash_blocks(t, 64, E)
    changed = t.copy()
    changed[10] = 999
    other = hash_blocks(changed, 64, E)
    assert all(a != b for a, b in zip(base, other, strict=True))  # a change flows down the chain
    extras = (ExtraKeys("m2"), ExtraKeys("m", adapter_id="lora"), ExtraKeys("m", cache_salt="s"))
    for extra in extras:
        assert hash_blocks(t, 64, extra)[0] != base[0]
    assert all(len(h) == 16 for h in base)


def test_bad_tokens() -> None:
    with pytest.raises(InvalidInput):
        hash_blocks([-1, 2], 1, E)
    with pytest.raises(InvalidInput):
        hash_blocks(np.zeros((2, 2), dtype=int), 1, E)
    with pytest.raises(InvalidInput):
        hash_blocks([1], 0, E)
