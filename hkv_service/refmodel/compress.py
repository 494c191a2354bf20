"""Compressors: how raw per-token K/V become compressed entries, and which raw tokens wait.

One rule serves both compressed groups (ratio r, overlap ov; c4: r=4, ov=4; c128: r=128, ov=0):

    entry j pools the raw tokens [r*j - ov, r*j + r)       (positions < 0 are absent)
    entry j is complete once token r*j + r - 1 is processed
    at cache length L:  n(L) = L // r complete entries
                        tail(L) = raw tokens [max(0, r*n(L) - ov), L)    (<= ov + r - 1 of them)
    query t (length t+1) sees entries j < n(t+1) and the raw tokens [r*n(t+1), t]

c4 at L = 128 (a block boundary; n = 32 entries complete, 0 raw tokens waiting):

    token    116 ... 119 | 120 ... 123 | 124 125 126 127 | 128 129 130 131 | ...
    entry 30 [116 ......... 124)
    entry 31              [120 ............. 128)            <- complete at L = 128
    entry 32                            [124 ............................. 132)
                                         '-- tail(128) --'    <- compressor state

So even at a block boundary the c4 TAIL carries 4 raw tokens: without them entry 32 (complete
at token 131) cannot be produced. The c128 tail is empty at multiples of 128 and holds up to 127
raw tokens in between.

Pooling is a softmax over the window's valid slots of ``gate . K_s + pos_bias[slot]``; the entry
is the weighted sum of the raw K|V, the indexer key the weighted sum of ``tanh(feat(K|V))``.
Everything is computed in float64 from the float32 raw K/V the cache holds, then rounded to
float32 for storage.
"""

from __future__ import annotations

import torch

from .weights import COMPUTE_DTYPE, IndexerWeights, PoolWeights

__all__ = ["entries_from", "index_keys_from", "pool_window", "tail_start"]


def tail_start(length: int, ratio: int, overlap: int) -> int:
    """First raw token the compressor still needs at ``length`` (see the map above)."""
    return max(0, ratio * (length // ratio) - overlap)


def pool_window(
    raw: torch.Tensor, raw_lo: int, entries: range, ratio: int, overlap: int, pw: PoolWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooling weights [m, r+ov] and the windows' raw K|V [m, r+ov, 2, dh] for ``entries``.

    ``raw`` holds the float32 raw K|V of tokens [raw_lo, raw_lo + len(raw)) and must cover
    every valid position of every window.
    """
    j = torch.arange(entries.start, entries.stop, device=raw.device)
    pos = ratio * j[:, None] - overlap + torch.arange(ratio + overlap, device=raw.device)[None]
    valid = pos >= 0
    rel = (pos - raw_lo).clamp(min=0)
    assert bool(((rel < raw.shape[0]) | ~valid).all()), "raw tokens do not cover the windows"
    win = raw.to(COMPUTE_DTYPE)[rel]
    score = (win[..., 0, :] @ pw.gate + pw.pos_bias).masked_fill(~valid, float("-inf"))
    return torch.softmax(score, dim=-1), win


def entries_from(weights: torch.Tensor, win: torch.Tensor) -> torch.Tensor:
    """Compressed K|V entries [m, 2, dh], float32."""
    return torch.einsum("ms,mshd->mhd", weights, win).to(torch.float32)


def index_keys_from(weights: torch.Tensor, win: torch.Tensor, iw: IndexerWeights) -> torch.Tensor:
    """Indexer keys [m, 1, index_dim], float32: pooled like the entries, from their own features."""
    feat = torch.tanh(win.flatten(2) @ iw.feat)
    return torch.einsum("ms,msi->mi", weights, feat).unsqueeze(1).to(torch.float32)
