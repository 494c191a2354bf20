"""The three attention layers, each run over one chunk of new tokens [a, b) given the cache at a.

Every layer is single-head, pre-norm, residual; its K/V are rounded to float32 (the cache's
dtype) *before* any query uses them, whether they came from the cache or from this chunk, so a
resumed run sees exactly the numbers a full run sees. Key sets per query t, by layer:

    L0 swa      raw K|V of tokens [max(0, t - W), t]                            (W = 128)
    L1 sparse   c4 entries j < (t+1)//4 kept by the indexer's top-k
                + raw K|V of tokens [4*((t+1)//4), t]                           (0..3 tokens)
    L2 heavy    c128 entries j < (t+1)//128
                + raw K|V of tokens [128*((t+1)//128), t]                       (0..127 tokens)

So continuing at p needs swa tokens [p - W, p) (blocks wholly before p - W are never read),
every c4/idx/c128 entry before p, and the compressors' tails (see :mod:`.compress`).

Indexer. Query t's score for entry j is ``q_idx(t) . key_j``; the top_k visible entries by
score are kept (all of them while at most top_k are visible; ties at the threshold are all
kept). A kept entry's attention logit is ``q.k/sqrt(dh) + index_bias * score``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cache import CompressedState
from .compress import entries_from, index_keys_from, pool_window, tail_start
from .config import RefModelConfig
from .weights import COMPUTE_DTYPE, AttnWeights, IndexerWeights, PoolWeights

__all__ = ["CompressedLayer", "Indexer", "make_indexer", "rms_norm", "swa_layer"]

NEG_INF = float("-inf")


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _kv(x: torch.Tensor, w: AttnWeights) -> torch.Tensor:
    """This chunk's raw K|V [n, 2, dh], rounded to the cache's float32."""
    return (x @ w.wkv).view(x.shape[0], 2, -1).to(torch.float32)


def _attend(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(dh) + bias) V over float32 ``kv`` [m, 2, dh]; bias -inf masks."""
    kv64 = kv.to(COMPUTE_DTYPE)
    scores = q @ kv64[:, 0].T / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(scores, dim=-1) @ kv64[:, 1]


def _band(t: torch.Tensor, s: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Additive mask [n, m]: 0 where lo[i] <= s[j] <= t[i], else -inf."""
    ok = (s[None] >= lo[:, None]) & (s[None] <= t[:, None])
    return torch.zeros(ok.shape, dtype=COMPUTE_DTYPE, device=t.device).masked_fill(~ok, NEG_INF)


def swa_layer(
    swa_kv: torch.Tensor, swa_lo: int, x: torch.Tensor, a: int, window: int, w: AttnWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0 over normed ``x`` (tokens [a, a+n)). Returns (output, this chunk's raw K|V)."""
    lo = max(0, a - window)
    assert swa_lo <= lo, f"swa tokens from {lo} needed, cache holds from {swa_lo}"
    new = _kv(x, w)
    kv = torch.cat([swa_kv[lo - swa_lo :], new])  # tokens [lo, b)
    t = torch.arange(a, a + x.shape[0], device=x.device)
    s = torch.arange(lo, a + x.shape[0], device=x.device)
    out = _attend(x @ w.wq, kv, _band(t, s, (t - window).clamp(min=0)))
    return out @ w.wo, new


@dataclass(frozen=True)
class Indexer:
    weights: IndexerWeights
    top_k: int
    index_bias: float

    def bias(self, x: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Additive logits [n, m] over the entries: -inf unless visible and in the top-k."""
        score = (x @ self.weights.wq) @ keys[:, 0].to(COMPUTE_DTYPE).T
        masked = score.masked_fill(~visible, NEG_INF)
        keep = visible
        if self.top_k < score.shape[-1]:
            kth = masked.topk(self.top_k, dim=-1).values[:, -1:]
            keep = visible & (masked >= kth)
        return (self.index_bias * score).masked_fill(~keep, NEG_INF)


@dataclass(frozen=True)
class CompressedLayer:
    """Layer 1 (with an indexer) or layer 2 (without): compressed entries + the raw tail."""

    ratio: int
    overlap: int
    attn: AttnWeights
    pool: PoolWeights
    indexer: Indexer | None = None

    def __call__(
        self, state: CompressedState, x: torch.Tensor, a: int
    ) -> tuple[torch.Tensor, CompressedState]:
        b, r = a + x.shape[0], self.ratio
        raw_lo = tail_start(a, r, self.overlap)
        raw = torch.cat([state.tail, _kv(x, self.attn)])  # tokens [raw_lo, b)
        new_state = self._grow(state, raw, raw_lo, range(a // r, b // r))
        t = torch.arange(a, b, device=x.device)
        seen = r * ((t + 1) // r)  # entries [0, seen/r) and raw tokens [seen, t]
        visible = (
            torch.arange(new_state.entries.shape[0], device=x.device)[None] < (seen // r)[:, None]
        )
        ent_bias = self._entry_bias(x, new_state, visible)
        raw_bias = _band(t, torch.arange(raw_lo, b, device=x.device), seen)
        kv = torch.cat([new_state.entries, raw])
        out = _attend(x @ self.attn.wq, kv, torch.cat([ent_bias, raw_bias], dim=-1))
        tail = raw[tail_start(b, r, self.overlap) - raw_lo :]
        return out @ self.attn.wo, CompressedState(new_state.entries, tail, new_state.index_keys)

    def _grow(
        self, state: CompressedState, raw: torch.Tensor, raw_lo: int, new: range
    ) -> CompressedState:
        """Append the entries (and indexer keys) completed in this chunk; tail left as is."""
        weights, win = pool_window(raw, raw_lo, new, self.ratio, self.overlap, self.pool)
        entries = torch.cat([state.entries, entries_from(weights, win)])
        if self.indexer is None:
            return CompressedState(entries, state.tail)
        assert state.index_keys is not None
        keys = index_keys_from(weights, win, self.indexer.weights)
        return CompressedState(entries, state.tail, torch.cat([state.index_keys, keys]))

    def _entry_bias(
        self, x: torch.Tensor, state: CompressedState, visible: torch.Tensor
    ) -> torch.Tensor:
        if self.indexer is None:
            zero = torch.zeros(visible.shape, dtype=COMPUTE_DTYPE, device=x.device)
            return zero.masked_fill(~visible, NEG_INF)
        assert state.index_keys is not None
        return self.indexer.bias(x, state.index_keys, visible)


def make_indexer(cfg: RefModelConfig, weights: IndexerWeights) -> Indexer:
    return Indexer(weights=weights, top_k=cfg.top_k, index_bias=cfg.index_bias)
