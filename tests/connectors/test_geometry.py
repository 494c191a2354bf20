"""hkv's cache spec from vLLM's KV-cache groups, and every config it refuses, with a sentence."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
)

from hkv_service.connectors.errors import UnsupportedKVCache
from hkv_service.connectors.geometry import LAYOUT, geometry_from
from hkv_service.core.layout import Layout
from hkv_service.core.spec import GroupKind

F32 = torch.float32


def config(*groups: tuple[list[str], KVCacheSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def full(**kw: object) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=F32, **kw)


def swa(window: int = 128, **kw: object) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=F32,
                             sliding_window=window, **kw)


def test_full_attention_is_one_compressed_group_of_ratio_1() -> None:
    geo = geometry_from(config((["l1", "l3"], full())), "m", "0.32")
    (g,) = geo.spec.groups
    assert (g.kind, g.block_size, g.ratio, g.overlap) == (GroupKind.COMPRESSED, 16, 1, 0)
    assert g.abi.dtype == "float32" and g.abi.layout == LAYOUT
    assert g.abi.head_shape == (2, 2, 64)  # layers, heads, K+V elements
    assert g.bytes_per_block == geo.groups[0].block_bytes == 2 * 2 * 16 * 64 * 4
    assert geo.block_errors
    assert [c.name for c in Layout(geo.spec).columns] == ["g0"]  # no tail object


def test_sliding_window_and_full_attention_are_two_groups() -> None:
    geo = geometry_from(config((["l0", "l2"], swa()), (["l1", "l3"], full())), "m", "0.32")
    kinds = [(g.kind, g.window) for g in geo.spec.groups]
    assert kinds == [(GroupKind.SWA, 128), (GroupKind.COMPRESSED, 0)]
    assert geo.hash_block_size == 16 and geo.lcm == 16
    assert not geo.block_errors
    assert geo.groups[0].layers == ("l0", "l2")


def test_a_window_below_the_block_is_widened_to_it_and_retained_tokens_count() -> None:
    geo = geometry_from(config((["a"], swa(window=8)), (["b"], full())), "m", "0.32")
    assert geo.spec.groups[0].window == 16  # wider than vLLM's is safe: hkv needs more
    geo = geometry_from(config((["a"], swa(extra_retained_tokens=32)), (["b"], full())),
                        "m", "0.32")
    assert geo.spec.groups[0].window == 160


def test_deepseek_v4_kinds_map_compressed_indexer_and_compressor_state() -> None:
    c4 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=32, dtype=F32,
                          tokens_per_state=4)
    idx = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=32, dtype=F32,
                           tokens_per_state=4, cache_role=SparseCacheRole.INDEXER)
    c128 = MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=512, dtype=F32,
                            tokens_per_state=128)
    state = SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=32, dtype=F32,
                                 sliding_window=8)
    geo = geometry_from(config((["c4"], c4), (["k.indexer"], idx), (["c128"], c128),
                               (["state"], state)), "dsv4", "0.32")
    g = {x.name: x for x in geo.spec.groups}
    assert (g["g0"].kind, g["g0"].ratio, g["g0"].entries_per_block) == (GroupKind.COMPRESSED, 4, 16)
    assert (g["g1"].kind, g["g1"].indexes) == (GroupKind.INDEXER, "g0")
    assert (g["g2"].kind, g["g2"].ratio) == (GroupKind.COMPRESSED, 128)
    assert (g["g3"].kind, g["g3"].window) == (GroupKind.SWA, 8)  # compressor state of 8 tokens
    assert geo.hash_block_size == 4 and geo.lcm == 128
    # the indexer found by its layer name too (DeepSeek-V4 leaves cache_role at its default)
    plain = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=16, dtype=F32,
                             tokens_per_state=4)
    geo = geometry_from(config((["c4"], c4), (["m.indexer.k_cache"], plain)), "dsv4", "0.32")
    assert geo.spec.groups[1].kind is GroupKind.INDEXER


def test_the_abi_names_what_makes_bytes_differ() -> None:
    a = geometry_from(config((["l"], full())), "m", "0.32").spec.groups[0].abi
    b = geometry_from(config((["l"], FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16))), "m", "0.32"
    ).spec.groups[0].abi
    c = geometry_from(config((["l"], full())), "m", "0.33").spec.groups[0].abi
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3


REFUSED = {
    # a Mamba group without prefix caching keeps no state hkv could restore
    "mamba": (MambaSpec(block_size=16, shapes=((4,),), dtypes=(F32,)),
              "mamba_cache_mode 'none': hkv restores states only in 'align' mode"),
    "cross_attention": (CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                                           dtype=F32), "hkv maps only"),
    "sink": (SinkFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=F32,
                                   sink_len=4), "hkv maps only"),
    "chunked_local": (ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                                                dtype=F32, attention_chunk_size=64),
                      "hkv maps only"),
    "chunk_in_full": (full(attention_chunk_size=64), "chunked local attention"),
    "non_causal": (full(non_causal=True), "non-causal"),
    "int8_heads": (full(kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD), "quantisation"),
    "fp8_e5m2": (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                                   dtype=torch.float8_e5m2), "dtype"),
    "bounded_replay": (SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=32,
                                            dtype=F32, sliding_window=128,
                                            bounded_replay=True), "prefix-cache"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_configs_hkv_cannot_represent_are_refused_with_a_sentence(name: str) -> None:
    spec, words = REFUSED[name]
    with pytest.raises(UnsupportedKVCache) as err:
        geometry_from(config((["a"], full()), (["b"], spec)), "m", "0.32")
    assert words in str(err.value)
    assert err.value.group in (1, -1) and err.value.spec_type


def test_an_indexer_without_exactly_one_kv_to_index_is_refused() -> None:
    idx = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=32, dtype=F32,
                           tokens_per_state=4, cache_role=SparseCacheRole.INDEXER)
    with pytest.raises(UnsupportedKVCache, match="exactly one compressed group"):
        geometry_from(config((["idx"], idx), (["f"], full())), "m", "0.32")
