"""Layer 3: a gated linear recurrence (GLA / GatedDeltaNet-style, without the delta rule), whose
whole history is one fixed-size state. Per token t, from the normed input x_t::

    u_t   = x_t W_u                       [dk+dv], rounded to float32 (the conv state's dtype)
    c_t   = silu(sum_j conv[j] * u_{t-K+1+j})      short causal depthwise conv, kernel K
    k_t   = c_t[:dk] / sqrt(dk),  v_t = c_t[dk:]
    a_t   = sigmoid(x_t W_a + a_bias)     [dk], per key channel; near 0.98: a slow decay
    S_t   = diag(a_t) S_{t-1} + k_t v_t^T  [dk, dv]
    o_t   = rms(q_t S_t) W_o,  q_t = x_t W_q

The state at a position p is ``(u_{p-K+1} .. u_{p-1}, S_p)``: the conv state (its last K-1
inputs, zeros before token 0) and the recurrent state, both float32. A chunk [a, b) is
computed in closed form from the state at a (cumulative log-decays, float64; the
gates are bounded, so a chunk's decays stay far inside float64's range); the state at b
is rounded to float32 *before* the next chunk uses it, in a full pass as in a resumed one, so
resuming at a multiple of the chunk from an exported-and-imported state replays the same
operations on the same numbers (bit-equal logits). A state from any other position, or in
another dtype, is a different state: the logits after the resume point differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .weights import COMPUTE_DTYPE, RecurrentWeights

__all__ = ["RecurrentState", "recurrent_layer"]


@dataclass(frozen=True)
class RecurrentState:
    conv: torch.Tensor  # [K-1, dk+dv] float32: the conv's last K-1 inputs
    ssm: torch.Tensor  # [dk, dv] float32: S


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def recurrent_layer(state: RecurrentState, x: torch.Tensor, w: RecurrentWeights
                    ) -> tuple[torch.Tensor, RecurrentState]:
    """Layer 3 over normed ``x`` [n, d] (float64) from ``state``: (output, the state after)."""
    n, dk = x.shape[0], w.wq.shape[1]
    kern = w.conv.shape[0]
    u = (x @ w.wu).to(torch.float32)
    ext = torch.cat([state.conv, u]).to(COMPUTE_DTYPE)  # inputs [a-K+1, b)
    c = sum(ext[j : j + n] * w.conv[j] for j in range(kern))
    assert isinstance(c, torch.Tensor)
    c = torch.nn.functional.silu(c)
    k, v = c[:, :dk] / math.sqrt(dk), c[:, dk:]
    q = x @ w.wq
    cum = torch.cumsum(torch.nn.functional.logsigmoid(x @ w.wa + w.a_bias), 0)  # [n, dk]
    s0 = state.ssm.to(COMPUTE_DTYPE)
    # o_t = q_t (diag(exp(A_t)) S_0 + sum_{s<=t} diag(exp(A_t - A_s)) k_s v_s^T), with
    # exp(A_t - A_s) = exp(A_t) exp(-A_s): the gates keep A within a few units over a chunk
    # (|log a| is about 0.02 a token), far from float64's range
    qa = q * cum.exp()
    mix = (qa @ (k * (-cum).exp()).T).tril()
    o = qa @ s0 + mix @ v
    s_end = cum[-1].exp()[:, None] * s0 + (k * (cum[-1] - cum).exp()).T @ v
    new = RecurrentState(ext[-(kern - 1):].to(torch.float32) if kern > 1 else state.conv,
                         s_end.to(torch.float32))
    return _rms(o) @ w.wo, new
