"""The tiny Qwen3-Next for tests: its one home is :mod:`hkv_service.bench.qwen3next` (``hkv
bench vllm --model qwen3-next`` builds the same model)."""

from hkv_service.bench.qwen3next import A_LOG_RANGE, QWEN3_NEXT, cached_model, write_model

__all__ = ["A_LOG_RANGE", "QWEN3_NEXT", "cached_model", "write_model"]
