"""A real ``vllm.LLM`` (the tiny hybrid Llama of ``vllm_e2e.py``, in this process) whose
connector reaches a running ``hkv up``; one prompt generated, its saves drained. Run by
``test_kv_events_vllm.py`` in a subprocess (vLLM keeps process-wide state):
``python tests/connectors/vllm_events.py MODEL ENDPOINT RAY_ADDRESS`` prints one JSON object
(the prompt's token ids)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(model: Path, endpoint: str, ray_address: str) -> dict[str, object]:
    from vllm import LLM, SamplingParams
    from vllm_e2e import connectors, shutdown
    from vllm_harness import prompt, served_transfer

    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=32, max_model_len=2048, max_num_seqs=4, gpu_memory_utilization=0.5,
              kv_transfer_config=served_transfer(endpoint, ray_address,
                                                 os.environ.get("HKV_SPEC_OUT")),
              enable_prefix_caching=True, seed=0)
    tokens = prompt(200, seed=3)
    llm.generate([{"prompt_token_ids": tokens}],
                 SamplingParams(max_tokens=3, temperature=0.0, detokenize=False),
                 use_tqdm=False)
    _, worker = connectors(llm)
    drained = worker.worker.drain(60.0)
    saved = int(worker.worker.stats.total["saved_blocks"])
    shutdown(llm)
    return {"tokens": tokens, "drained": drained, "saved_blocks": saved}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])))
