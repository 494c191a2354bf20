"""The reference model's knobs and the geometry it reads off a :class:`CacheSpec`.

Widths that are a matter of taste (vocab, d_model, seed, top-k) live in
:class:`RefModelConfig`; everything the cache layout fixes (head width, ratios, overlap,
window, block sizes) is *derived* from the spec by :func:`geometry_from_spec`, so the model
and the service can never disagree about a block's shape.

Roles. The spec names groups freely; the model finds them by kind:

    SWA group         -> layer 0, sliding-window attention over raw K/V   ("swa")
    INDEXER group     -> the lightning-indexer keys                        ("idx")
    its target group  -> layer 1, sparse compressed attention (+ overlap)  ("c4")
    other COMPRESSED  -> layer 2, heavily compressed attention             ("c128")
    RECURRENT group   -> layer 3, a gated linear recurrence, if the spec has one ("gla")

The recurrent group's state parts fix its widths: ``[[K-1, dk+dv], [dk, dv]]`` (the short
conv's last K-1 inputs over the key and value channels, then the recurrent state), float32.

Top-k. The default is the real family's 512. Past 512 visible ratio-4 entries (prompts over
2048 tokens) it *selects*; below that every entry is selected. So that a stale indexer block is
visible at every length, the indexer score also enters the sparse layer's attention logits as
a bias (``index_bias``, 0 turns that off and leaves pure selection).
"""

from __future__ import annotations

from dataclasses import dataclass

from hkv_service.core.spec import CacheSpec, GroupKind, GroupSpec

__all__ = ["Geometry", "RefModelConfig", "geometry_from_spec"]


@dataclass(frozen=True)
class RefModelConfig:
    vocab: int = 64
    d_model: int = 32
    top_k: int = 512  # ratio-4 entries the indexer keeps per query
    seed: int = 0
    index_bias: float = 1.0  # weight of the indexer score in the sparse layer's logits


@dataclass(frozen=True)
class Geometry:
    """The cache groups by role, plus the widths they fix."""

    swa: GroupSpec
    sparse: GroupSpec
    heavy: GroupSpec
    index: GroupSpec
    head_dim: int  # K and V width of every KV group (head_shape [2, head_dim])
    index_dim: int  # indexer key width (head_shape [1, index_dim])
    chunk: int  # tokens per forward chunk = the spec's LCM block size
    recurrent: GroupSpec | None = None  # layer 3's group; None: the attention-only model
    conv_kernel: int = 0  # the recurrent layer's short-conv width K
    key_dim: int = 0  # dk: the recurrent state is [dk, dv]
    value_dim: int = 0

    def by_name(self) -> dict[str, GroupSpec]:
        groups = [self.swa, self.sparse, self.heavy, self.index]
        if self.recurrent is not None:
            groups.append(self.recurrent)
        return {g.name: g for g in groups}


def _one(groups: list[GroupSpec], what: str) -> GroupSpec:
    if len(groups) != 1:
        raise ValueError(f"the reference model needs exactly one {what} group, got {len(groups)}")
    return groups[0]


def _check_kv_shape(g: GroupSpec, head_dim: int) -> None:
    if g.abi.dtype != "float32":
        raise ValueError(f"group {g.name!r}: the reference model stores float32, not {g.abi.dtype}")
    if g.kind is not GroupKind.INDEXER and g.abi.head_shape != (2, head_dim):
        raise ValueError(f"group {g.name!r}: head_shape must be [2, {head_dim}] (K and V)")


def geometry_from_spec(spec: CacheSpec) -> Geometry:
    """Find the four roles in ``spec``; raise ValueError if the spec does not fit the model."""
    by_kind: dict[GroupKind, list[GroupSpec]] = {k: [] for k in GroupKind}
    for g in spec.groups:
        by_kind[g.kind].append(g)
    swa = _one(by_kind[GroupKind.SWA], "SWA")
    index = _one(by_kind[GroupKind.INDEXER], "INDEXER")
    compressed = by_kind[GroupKind.COMPRESSED]
    sparse = _one([g for g in compressed if g.name == index.indexes], "indexed COMPRESSED")
    heavy = _one([g for g in compressed if g.name != index.indexes], "unindexed COMPRESSED")
    head_dim = swa.abi.head_shape[-1]
    for g in (swa, sparse, heavy, index):
        _check_kv_shape(g, head_dim)
    if len(index.abi.head_shape) != 2 or index.abi.head_shape[0] != 1:
        raise ValueError(f"group {index.name!r}: head_shape must be [1, index_dim]")
    rec = by_kind[GroupKind.RECURRENT]
    recurrent = _one(rec, "RECURRENT") if rec else None
    conv, dk, dv = _recurrent_widths(recurrent) if recurrent is not None else (0, 0, 0)
    return Geometry(
        recurrent=recurrent,
        conv_kernel=conv,
        key_dim=dk,
        value_dim=dv,
        swa=swa,
        sparse=sparse,
        heavy=heavy,
        index=index,
        head_dim=head_dim,
        index_dim=index.abi.head_shape[1],
        chunk=spec.lcm_block_size,
    )


def _recurrent_widths(g: GroupSpec) -> tuple[int, int, int]:
    """(K, dk, dv) from the state parts ``[[K-1, dk+dv], [dk, dv]]``, float32, one layer."""
    shapes = [p.shape for p in g.state]
    ok = (g.layers == 1 and len(shapes) == 2 and len(shapes[0]) == 2 and len(shapes[1]) == 2
          and all(p.dtype == "float32" for p in g.state)
          and shapes[0][1] == shapes[1][0] + shapes[1][1])
    if not ok:
        raise ValueError(f"group {g.name!r}: the reference model's recurrent layer keeps one "
                         "layer's state as [[K-1, dk+dv], [dk, dv]] float32 (conv, then state); "
                         f"got {[(p.shape, p.dtype) for p in g.state]} x {g.layers} layers")
    return shapes[0][0] + 1, shapes[1][0], shapes[1][1]
