"""hkv's :class:`CacheSpec` from vLLM's ``KVCacheConfig``: one hkv group per vLLM KV-cache group.

::

    vLLM group's spec (exact type)              hkv group
    FullAttentionSpec                           COMPRESSED, ratio 1: every block is kept
    MLAAttentionSpec, tokens_per_state r        COMPRESSED, ratio r (DeepSeek-V4 c4 / c128 KV)
    MLAAttentionSpec, indexer role or layers    INDEXER, ratio r, indexing the one COMPRESSED
                                                group with its block size and ratio
    SlidingWindowSpec, SlidingWindowMLASpec     SWA, window W = sliding_window + retained
                                                tokens (DeepSeek-V4's compressor state is
                                                such a group, of 8 or 128 tokens)
    MambaSpec, GDN_ATTN or MAMBA2, "align"      RECURRENT: one state object per boundary
                                                vLLM handed off (Qwen3-Next / Qwen3.5
                                                GatedDeltaNet; Nemotron-H, Granite 4,
                                                Falcon-H1 Mamba2), its parts' shapes and
                                                dtypes in the ABI
    anything else                               refused: UnsupportedKVCache, with a sentence

Token geometry is vLLM's: group ``g``'s block ``k`` covers tokens ``[k*bs_g, (k+1)*bs_g)``,
hkv's hash block is vLLM's (the GCD of the group block sizes unless vLLM resolved another)
and hkv's LCM block is vLLM's scheduler block, so a hit hkv certifies is one vLLM can take.

Bytes. vLLM hands every layer's cache to a connector as a ``[B, H, N, C]`` view (blocks, head
slots, states, content). One hkv block of group ``g`` is vLLM block ``b`` of every layer of
``g``, in the group's layer order, each layer's ``[H, N, C]`` page in that order. The ABI names
exactly that (dtype, ``layout`` "vllm-LHNC", ``head_shape`` (layers, H, C), the spec class, its
cache dtype and quantisation, vLLM's minor version), so a reader whose bytes would differ in
any of these never gets a hit. A wider SWA window than vLLM's is safe (hkv then needs more).

A recurrent layer's page is vLLM's raw ``[B, 1, 1, S]`` int8 view of its states packed in
``MambaSpec.shapes`` order (conv state, then the SSM / delta-rule state), ``S`` their bytes
without the page's padding. One state object is that of every layer of the group, in layer
order. Its ABI names each part's shape and dtype (the SSM state's dtype depends on the host
and ``--mamba-ssm-cache-dtype``), the recurrence, the conv-state layout and vLLM's minor
version. Only ``mamba_cache_mode`` "align" is mapped: it keeps states at block boundaries
and hands them off (``boundary_state_offloads``); "none" keeps no reusable state and "all"
and speculative blocks were never checked with hkv.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm import envs
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
)

from hkv_service.core.errors import SpecError
from hkv_service.core.ids import GroupName
from hkv_service.core.spec import DTYPE_BYTES, CacheSpec, GroupKind, spec_from_dict

from .errors import UnsupportedKVCache

__all__ = ["LAYOUT", "Geometry", "GroupMap", "geometry_from"]

LAYOUT = "vllm-LHNC"  # layers, head slots, states, content: see the module docstring
STATE_LAYOUT = "vllm-mamba-packed"  # layers, each its states in MambaSpec.shapes order
# Recurrences whose hand-off and load hkv checked (GDN on a real engine here, Mamba2 through
# vLLM's scheduler with Nemotron-H's specs): a state is one tensor set per layer, exported at
# block boundaries in align mode. Others (Mamba1, short conv, linear attention) were not.
STATE_KINDS = frozenset({"GDN_ATTN", "MAMBA2"})
# Page bytes are self-contained under these: a per-tensor FP8 scale is the model's (keyed by
# the model id); the other modes keep scales beside the page or were never checked here.
_QUANT_OK = frozenset({KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR})
_DTYPE_NAME = {getattr(torch, name): name for name in DTYPE_BYTES}


@dataclass(frozen=True, slots=True)
class GroupMap:
    """One vLLM KV-cache group as an hkv group (the column of the same name)."""

    vllm_group: int  # index in KVCacheConfig.kv_cache_groups
    name: GroupName
    kind: GroupKind
    block_size: int  # tokens per block
    layers: tuple[str, ...]  # the group's layers, in the order their pages are stored
    page_bytes: int  # one layer's [H, N, C] page of one block

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * len(self.layers)

    @property
    def recurrent(self) -> bool:
        """A state group: saved only from vLLM's boundary hand-offs, loaded into the one
        block vLLM plans for the hit (its block table is not positional)."""
        return self.kind is GroupKind.RECURRENT


@dataclass(frozen=True, slots=True)
class Geometry:
    spec: CacheSpec
    groups: tuple[GroupMap, ...]

    @property
    def hash_block_size(self) -> int:
        return self.spec.hash_block_size

    @property
    def lcm(self) -> int:
        return self.spec.lcm_block_size

    def depth_of(self, group: GroupMap, block: int) -> int:
        """Depth of the prefix entry holding ``group``'s block ``block`` (its last token)."""
        return (block + 1) * group.block_size // self.hash_block_size - 1

    def block_of(self, group: GroupMap, depth: int) -> int:
        """Index of ``group``'s block that ends at the entry of ``depth``."""
        return (depth + 1) * self.hash_block_size // group.block_size - 1

    @property
    def block_errors(self) -> bool:
        """Whether a failed load is reported per block (vLLM then keeps the blocks before the
        first failed one): only for one full-attention group, the one layout where vLLM can
        map block ids back to requests and a shorter prefix needs nothing else. Any other
        layout fails the request's whole load (``failed_recving``) and recomputes it."""
        g = self.spec.groups
        return len(g) == 1 and g[0].kind is GroupKind.COMPRESSED and g[0].ratio == 1

    def reader_abi(self) -> dict[str, int]:
        """group -> ABI fingerprint, for lookups (funnel layer 2)."""
        return {g.name: g.abi.fingerprint() for g in self.spec.groups}


@dataclass(frozen=True, slots=True)
class _Mapped:
    kind: GroupKind
    ratio: int
    window: int = 0


def _attention(index: int, spec: Any) -> AttentionSpec:
    name = type(spec).__name__
    if not isinstance(spec, AttentionSpec):
        raise UnsupportedKVCache(index, name, "not an attention cache")
    if spec.dtype not in _DTYPE_NAME:
        raise UnsupportedKVCache(index, name, f"dtype {spec.dtype} is not one of "
                                 f"{sorted(DTYPE_BYTES)}")
    if spec.kv_quant_mode not in _QUANT_OK:
        raise UnsupportedKVCache(index, name, f"KV quantisation {spec.kv_quant_mode.name} keeps "
                                 "state outside the page (or was never checked with hkv)")
    tps = spec.tokens_per_state
    if not isinstance(tps, int) or tps < 1 or spec.block_size % tps:
        raise UnsupportedKVCache(index, name, f"tokens_per_state {tps} must be a whole number "
                                 f"of tokens dividing the block size {spec.block_size}")
    if getattr(spec, "non_causal", False):
        raise UnsupportedKVCache(index, name, "non-causal attention: a prefix's KV depends on "
                                 "what follows it")
    return spec


def _full(index: int, group: KVCacheGroupSpec) -> _Mapped:
    spec = _attention(index, group.kv_cache_spec)
    assert isinstance(spec, FullAttentionSpec)
    if spec.attention_chunk_size is not None:
        raise UnsupportedKVCache(index, type(spec).__name__, "chunked local attention")
    return _Mapped(GroupKind.COMPRESSED, 1)


def _mla(index: int, group: KVCacheGroupSpec) -> _Mapped:
    spec = _attention(index, group.kv_cache_spec)
    assert isinstance(spec, MLAAttentionSpec)
    indexer = spec.cache_role is SparseCacheRole.INDEXER or all(
        "indexer" in layer for layer in group.layer_names)
    kind = GroupKind.INDEXER if indexer else GroupKind.COMPRESSED
    return _Mapped(kind, int(spec.tokens_per_state))


def _swa(index: int, group: KVCacheGroupSpec) -> _Mapped:
    spec = _attention(index, group.kv_cache_spec)
    assert isinstance(spec, SlidingWindowSpec)
    if isinstance(spec, SlidingWindowMLASpec) and spec.bounded_replay:
        raise UnsupportedKVCache(index, type(spec).__name__, "bounded replay: vLLM rebuilds "
                                 "this window itself and takes no hit for it")
    window = spec.sliding_window + spec.extra_retained_tokens
    return _Mapped(GroupKind.SWA, int(spec.tokens_per_state), max(window, spec.block_size))


def _mamba(index: int, group: KVCacheGroupSpec) -> _Mapped:
    spec = group.kv_cache_spec
    assert isinstance(spec, MambaSpec)
    name = type(spec).__name__
    kind = spec.mamba_type.name
    if kind not in STATE_KINDS:
        raise UnsupportedKVCache(index, name, f"recurrence {kind} was never checked with hkv "
                                 f"(it serves {sorted(STATE_KINDS)})")
    if spec.mamba_cache_mode != "align":
        raise UnsupportedKVCache(index, name, f"mamba_cache_mode {spec.mamba_cache_mode!r}: hkv "
                                 "restores states only in 'align' mode (prefix caching on), "
                                 "where vLLM keeps them at block boundaries and hands them off")
    if spec.num_speculative_blocks:
        raise UnsupportedKVCache(index, name, "speculative state blocks (MTP / EAGLE) were never "
                                 "checked with hkv")
    for dtype in spec.dtypes:
        if dtype not in _DTYPE_NAME:
            raise UnsupportedKVCache(index, name, f"state dtype {dtype} is not one of "
                                     f"{sorted(DTYPE_BYTES)}")
    return _Mapped(GroupKind.RECURRENT, 1)


_MAPPERS: dict[type, Callable[[int, KVCacheGroupSpec], _Mapped]] = {
    FullAttentionSpec: _full,
    MLAAttentionSpec: _mla,
    SlidingWindowSpec: _swa,
    SlidingWindowMLASpec: _swa,
    MambaSpec: _mamba,
}


def _map_group(index: int, group: KVCacheGroupSpec) -> _Mapped:
    spec = group.kv_cache_spec
    mapper = _MAPPERS.get(type(spec))
    if mapper is None:
        raise UnsupportedKVCache(index, type(spec).__name__, "hkv maps only "
                                 f"{sorted(t.__name__ for t in _MAPPERS)} groups")
    if not group.enable_kv_transfer or not spec.prefix_cacheable:
        raise UnsupportedKVCache(index, type(spec).__name__, "vLLM does not transfer or "
                                 "prefix-cache this group, so hkv could not restore it")
    return mapper(index, group)


def _abi(spec: AttentionSpec, layers: int, vllm_version: str) -> dict[str, Any]:
    elem = DTYPE_BYTES[_DTYPE_NAME[spec.dtype]]
    content = spec.state_content_size_bytes
    if content % elem:
        raise UnsupportedKVCache(-1, type(spec).__name__, f"its {content}-byte state is not "
                                 f"whole {spec.dtype} elements")
    cache_dtype = getattr(spec, "cache_dtype_str", None) or _DTYPE_NAME[spec.dtype]
    return {
        "dtype": _DTYPE_NAME[spec.dtype],
        "layout": LAYOUT,
        "head_shape": [layers, spec.num_heads, content // elem],
        "kernel_version": f"vllm{vllm_version}:{type(spec).__name__}:{cache_dtype}:"
                          f"{spec.kv_quant_mode.name}:hs{spec.head_size}/{spec.head_size_v}",
    }


def _state_group(spec: MambaSpec, layers: int, vllm_version: str) -> dict[str, Any]:
    """A RECURRENT group's state parts, recurrence and ABI (see the module docstring)."""
    parts = [{"shape": list(shape), "dtype": _DTYPE_NAME[dtype]}
             for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)]
    conv = envs.VLLM_SSM_CONV_STATE_LAYOUT or "default"
    return {
        "state_kind": spec.mamba_type.name, "layers": layers, "state": parts,
        "abi": {"dtype": parts[-1]["dtype"], "layout": STATE_LAYOUT, "head_shape": [layers],
                "kernel_version": f"vllm{vllm_version}:{type(spec).__name__}:"
                                  f"{spec.mamba_type.name}:{spec.mamba_cache_mode}:conv-{conv}"},
    }


def _indexes(index: int, mapped: Sequence[_Mapped], groups: Sequence[KVCacheGroupSpec]
             ) -> str | None:
    """The COMPRESSED group an INDEXER group indexes: the one with its block size and ratio."""
    me = mapped[index]
    if me.kind is not GroupKind.INDEXER:
        return None
    bs = groups[index].kv_cache_spec.block_size
    targets = [i for i, m in enumerate(mapped) if m.kind is GroupKind.COMPRESSED
               and m.ratio == me.ratio and groups[i].kv_cache_spec.block_size == bs]
    if len(targets) != 1:
        raise UnsupportedKVCache(index, "MLAAttentionSpec", f"an indexer needs exactly one "
                                 f"compressed group of block size {bs} and ratio {me.ratio} "
                                 f"to index, found {len(targets)}")
    return f"g{targets[0]}"


def geometry_from(config: KVCacheConfig, model_id: str, vllm_version: str) -> Geometry:
    """hkv's spec for ``config``; raises UnsupportedKVCache (a sentence) for a config hkv
    cannot represent."""
    groups = list(config.kv_cache_groups)
    if not groups:
        raise UnsupportedKVCache(-1, "KVCacheConfig", "the model has no KV cache to store")
    mapped = [_map_group(i, g) for i, g in enumerate(groups)]
    sizes = [g.kv_cache_spec.block_size for g in groups]
    hash_block = config.hash_block_size or math.gcd(*sizes)
    raw_groups = []
    for i, (g, m) in enumerate(zip(groups, mapped, strict=True)):
        spec = g.kv_cache_spec
        raw: dict[str, Any] = {"name": f"g{i}", "kind": m.kind.value,
                               "block_size": spec.block_size}
        if isinstance(spec, MambaSpec):
            raw_groups.append({**raw, **_state_group(spec, len(g.layer_names), vllm_version)})
            continue
        assert isinstance(spec, AttentionSpec)
        raw.update(ratio=m.ratio, window=m.window,
                   abi=_abi(spec, len(g.layer_names), vllm_version))
        target = _indexes(i, mapped, groups)
        if target is not None:
            raw["indexes"] = target
        raw_groups.append(raw)
    try:
        cache_spec = spec_from_dict(
            {"model_id": model_id, "hash_block_size": hash_block, "groups": raw_groups})
    except SpecError as err:
        raise UnsupportedKVCache(-1, "KVCacheConfig", f"hkv cannot represent it: {err}") from None
    maps = tuple(
        GroupMap(i, GroupName(f"g{i}"), m.kind, g.kv_cache_spec.block_size,
                 tuple(g.layer_names), _page_bytes(g.kv_cache_spec))
        for i, (g, m) in enumerate(zip(groups, mapped, strict=True))
    )
    return Geometry(cache_spec, maps)


def _page_bytes(spec: Any) -> int:
    if isinstance(spec, MambaSpec):  # the states, without the page's padding
        return int(spec.real_page_size_bytes)
    return int(spec.num_heads * spec.num_states * spec.state_content_size_bytes)
