"""Deterministic weights: one ``torch.Generator`` seeded from the config, drawn in a fixed order.

Every tensor is drawn on the CPU in float64 (so a seed means the same numbers on every machine)
and then moved to the model's device. Scales are ``1/sqrt(fan_in)`` so that each layer's
output is of the same order as the residual stream: a changed cache entry moves the logits
by far more than rounding noise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .config import Geometry, RefModelConfig

__all__ = ["AttnWeights", "IndexerWeights", "PoolWeights", "RecurrentWeights", "Weights",
           "init_weights"]

COMPUTE_DTYPE = torch.float64


@dataclass(frozen=True)
class AttnWeights:
    wq: torch.Tensor  # [d_model, head_dim]
    wkv: torch.Tensor  # [d_model, 2*head_dim] -> K | V
    wo: torch.Tensor  # [head_dim, d_model]


@dataclass(frozen=True)
class PoolWeights:
    """Softmax pooling of ratio+overlap raw tokens into one entry."""

    gate: torch.Tensor  # [head_dim]: score of a raw token from its K
    pos_bias: torch.Tensor  # [ratio + overlap]: score of each slot in the pooling window


@dataclass(frozen=True)
class IndexerWeights:
    wq: torch.Tensor  # [d_model, index_dim]: the query's indexer vector
    feat: torch.Tensor  # [2*head_dim, index_dim]: a raw token's indexer feature from its K|V


@dataclass(frozen=True)
class RecurrentWeights:
    """The gated linear recurrence (layer 3): see :mod:`.recurrent`."""

    wu: torch.Tensor  # [d_model, dk+dv]: the conv's input (key | value channels)
    conv: torch.Tensor  # [K, dk+dv]: depthwise causal conv taps, oldest first
    wq: torch.Tensor  # [d_model, dk]
    wa: torch.Tensor  # [d_model, dk]: the decay gate's logit
    a_bias: torch.Tensor  # [dk]: a slow decay (gates near 0.98), so a state lost or one
    # boundary off changes many tokens after the resume point, not only the first few
    wo: torch.Tensor  # [dv, d_model]


@dataclass(frozen=True)
class Weights:
    emb: torch.Tensor  # [vocab, d_model]
    swa: AttnWeights
    sparse: AttnWeights
    heavy: AttnWeights
    sparse_pool: PoolWeights
    heavy_pool: PoolWeights
    indexer: IndexerWeights
    out: torch.Tensor  # [d_model, vocab]
    recurrent: RecurrentWeights | None = None  # drawn last: the attention layers' stay as they were


class _Draw:
    def __init__(self, seed: int, device: torch.device) -> None:
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        self._device = device

    def __call__(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(shape, generator=self._gen, dtype=COMPUTE_DTYPE) * scale
        return t.to(self._device)


def _attn(draw: _Draw, d: int, dh: int) -> AttnWeights:
    return AttnWeights(
        wq=draw(d, dh, scale=1 / math.sqrt(d)),
        wkv=draw(d, 2 * dh, scale=1 / math.sqrt(d)),
        wo=draw(dh, d, scale=2 / math.sqrt(dh)),
    )


def _pool(draw: _Draw, dh: int, slots: int) -> PoolWeights:
    return PoolWeights(gate=draw(dh, scale=1 / math.sqrt(dh)), pos_bias=draw(slots, scale=0.5))


def init_weights(cfg: RefModelConfig, geo: Geometry, device: torch.device) -> Weights:
    draw = _Draw(cfg.seed, device)
    d, dh = cfg.d_model, geo.head_dim
    w = Weights(
        emb=draw(cfg.vocab, d),
        swa=_attn(draw, d, dh),
        sparse=_attn(draw, d, dh),
        heavy=_attn(draw, d, dh),
        sparse_pool=_pool(draw, dh, geo.sparse.ratio + geo.sparse.overlap),
        heavy_pool=_pool(draw, dh, geo.heavy.ratio + geo.heavy.overlap),
        indexer=IndexerWeights(
            wq=draw(d, geo.index_dim, scale=1 / math.sqrt(d)),
            feat=draw(2 * dh, geo.index_dim, scale=1 / math.sqrt(2 * dh)),
        ),
        out=draw(d, cfg.vocab, scale=1 / math.sqrt(d)),
    )
    if geo.recurrent is None:
        return w
    dk, dv, k = geo.key_dim, geo.value_dim, geo.conv_kernel
    rec = RecurrentWeights(
        wu=draw(d, dk + dv, scale=1 / math.sqrt(d)),
        conv=draw(k, dk + dv, scale=1 / math.sqrt(k)),
        wq=draw(d, dk, scale=1 / math.sqrt(d)),
        wa=draw(d, dk, scale=0.3 / math.sqrt(d)),
        a_bias=draw(dk, scale=0.5) + 4.0,
        wo=draw(dv, d, scale=2 / math.sqrt(dv)),
    )
    return dataclasses.replace(w, recurrent=rec)
