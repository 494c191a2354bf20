"""RefModel: the correctness oracle. Same tokens in, same logits out, cached or not.

Architecture (single head per layer, pre-norm residual, float64 compute, float32 cache)::

    h = emb[token]                                    [d_model]
    h += L0 swa(rms(h))      sliding window, raw K/V        -> cache group swa
    h += L1 sparse(rms(h))   top-k c4 entries + raw tail    -> c4, idx, c4 TAIL
    h += L2 heavy(rms(h))    c128 entries + raw tail        -> c128, c128 TAIL
    h += L3 gla(rms(h))      gated linear recurrence        -> the RECURRENT group's state
                             (only when the spec has one; :mod:`.recurrent`)
    logits = rms(h) @ W_out                           [vocab]  (float32)

Every pass is ``extend``: tokens go through all three layers one *chunk* at a time, chunks cut
at absolute multiples of the spec's LCM block size (128)::

    forward_full / prefill:  [0,128) [128,256) ... [T - T%128, T)
    extend from p = 256:              ...      [256,384) ...

so resuming at a multiple of 128 from an exported-and-imported cache replays *the same
operations on the same numbers* as the full pass: on a given machine the logits are bit-equal.
Resuming elsewhere (e.g. one token at a time) changes only float64 summation order; the float32
logits then agree to within :data:`LOGITS_ATOL` (in practice they are usually equal too).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hkv_service.core.spec import CacheSpec

from . import blocks as blk
from .cache import ModelCache, empty_cache
from .config import RefModelConfig, geometry_from_spec
from .layers import CompressedLayer, make_indexer, rms_norm, swa_layer
from .recurrent import recurrent_layer
from .weights import init_weights

__all__ = ["LOGITS_ATOL", "LOGITS_RTOL", "RefModel"]

LOGITS_RTOL = 1e-5  # the oracle's tolerance between cached and recomputed float32 logits
LOGITS_ATOL = 1e-5


class RefModel:
    """A tiny seeded hybrid-attention model whose cache layout is a :class:`CacheSpec`.

    No call mutates a :class:`ModelCache` it is given; blocks it exports are copies.
    """

    def __init__(
        self,
        spec: CacheSpec,
        config: RefModelConfig = RefModelConfig(),  # noqa: B008 (frozen, so a safe default)
        device: str | torch.device = "cpu",
    ) -> None:
        if config.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {config.top_k}")
        self.spec = spec
        self.config = config
        self.device = torch.device(device)
        self.geometry = geometry_from_spec(spec)
        self.weights = w = init_weights(config, self.geometry, self.device)
        geo = self.geometry
        self._sparse = CompressedLayer(
            geo.sparse.ratio,
            geo.sparse.overlap,
            w.sparse,
            w.sparse_pool,
            make_indexer(config, w.indexer),
        )
        self._heavy = CompressedLayer(geo.heavy.ratio, geo.heavy.overlap, w.heavy, w.heavy_pool)

    # ---- token passes -----------------------------------------------------------------------

    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] (float32) for ``tokens`` [T], recomputed from nothing."""
        return self.prefill(tokens)[0]

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ModelCache]:
        return self.extend(self.empty_cache(), tokens)

    def empty_cache(self) -> ModelCache:
        return empty_cache(self.geometry, self.device)

    def extend(self, cache: ModelCache, tokens: torch.Tensor) -> tuple[torch.Tensor, ModelCache]:
        """Logits for ``tokens`` placed at [cache.length, cache.length + T), and the new cache."""
        tokens = self._checked_tokens(tokens)
        out = [torch.zeros((0, self.config.vocab), dtype=torch.float32, device=self.device)]
        start, step = 0, self.geometry.chunk
        while start < tokens.shape[0]:
            end = min(tokens.shape[0], start + step - (cache.length % step))
            logits, cache = self._chunk(cache, tokens[start:end])
            out.append(logits)
            start = end
        return torch.cat(out), cache

    def greedy_generate(self, cache: ModelCache, n: int) -> tuple[list[int], ModelCache]:
        """Append ``n`` argmax tokens, starting from the logits of token ``cache.length - 1``."""
        if cache.last_logits is None:
            raise ValueError("this cache has no last logits (imported?); extend() a token first")
        generated: list[int] = []
        for _ in range(n):
            assert cache.last_logits is not None
            generated.append(int(cache.last_logits.argmax()))
            _, cache = self.extend(cache, torch.tensor(generated[-1:]))
        return generated, cache

    def _checked_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"tokens must be a 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab})")
        return tokens.to(device=self.device, dtype=torch.int64)

    def _chunk(self, cache: ModelCache, tokens: torch.Tensor) -> tuple[torch.Tensor, ModelCache]:
        """One chunk [a, a+n) that does not cross a multiple of ``geometry.chunk``."""
        a, w = cache.length, self.weights
        h = w.emb[tokens]
        out, swa_new = swa_layer(
            cache.swa_kv, cache.swa_lo, rms_norm(h), a, self.geometry.swa.window, w.swa
        )
        h = h + out
        out, sparse = self._sparse(cache.sparse, rms_norm(h), a)
        h = h + out
        out, heavy = self._heavy(cache.heavy, rms_norm(h), a)
        h = h + out
        state = cache.recurrent
        if w.recurrent is not None:
            assert state is not None, "a recurrent model's cache carries its state"
            out, state = recurrent_layer(state, rms_norm(h), w.recurrent)
            h = h + out
        logits = (rms_norm(h) @ w.out).to(torch.float32)
        swa_kv = torch.cat([cache.swa_kv, swa_new])
        new = ModelCache(a + tokens.shape[0], cache.swa_lo, swa_kv, sparse, heavy, logits[-1],
                         state)
        return logits, new

    # ---- the block interface ----------------------------------------------------------------

    def block_shape(self, group: str) -> tuple[int, ...]:
        return blk.block_shape(self.geometry, group)

    def tail_shape(self, group: str) -> tuple[int, ...]:
        return blk.tail_shape(self.geometry, group)

    def export_block(self, cache: ModelCache, group: str, block_index: int) -> torch.Tensor:
        """A copy of ``group``'s block covering tokens [k*bs, (k+1)*bs)."""
        return blk.export_block(cache, self.geometry, group, block_index)

    def export_tail(self, cache: ModelCache, group: str) -> tuple[torch.Tensor, int]:
        """``group``'s raw tokens still needed at ``cache.length`` (exactly those rows), and
        their count."""
        return blk.export_tail(cache, self.geometry, group)

    def export_state(self, cache: ModelCache, group: str) -> torch.Tensor:
        """A copy of the recurrent group's state as of ``cache.length``: its parts flattened
        and concatenated in stored order (conv, then state), float32 [state_elements]."""
        return blk.export_state(cache, self.geometry, group)

    def state_parts(self, cache: ModelCache, group: str) -> tuple[torch.Tensor, ...]:
        """The same state as its parts, each in its own shape (copies)."""
        return blk.state_parts(cache, self.geometry, group)

    def import_cache(
        self,
        length: int,
        blocks: Mapping[str, Mapping[int, torch.Tensor]],
        tails: Mapping[str, tuple[torch.Tensor, int]],
        states: Mapping[str, torch.Tensor] | None = None,
    ) -> ModelCache:
        """Rebuild the cache at ``length``; ValueError names any missing or misshapen piece.

        A group's blocks may come as a :class:`~.blocks.BlockRun` (one stacked tensor): a run
        of exactly the blocks needed is adopted as the group's rows without a copy. A recurrent
        model needs its group's state as of exactly ``length`` in ``states`` (as
        :meth:`export_state` gives it), unless ``length`` is 0."""
        return blk.import_cache(self.geometry, length, blocks, tails, self.device, states)
