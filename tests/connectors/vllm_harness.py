"""vLLM's real Scheduler and the connector's both roles over a real in-process hkv, no model.

:class:`Harness` builds a ``KVCacheConfig`` with vLLM's own grouping from per-layer specs, an
``InProcessSystem`` (real shards, real LMDB tiers) running the spec the connector derives from
it, vLLM's ``Scheduler`` (which builds the scheduler-side connector itself) and a worker-side
connector over KV tensors allocated by vLLM's own allocator. :meth:`Harness.step` is one engine
step: schedule, a stand-in forward that writes each scheduled block's bytes as a function of
the tokens up to its end (so equal prefixes have equal KV, as in a model), the worker
connector's load / save / results, and ``update_from_output``.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import xxhash
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from hkv_service.bench.serve import TINY  # the tiny hybrid Llama: one home
from hkv_service.connectors import systems
from hkv_service.connectors.vllm import HkvConnector, HkvConnectorMetadata, engine_geometry
from hkv_service.core.layout import Layout
from workers.inprocess import InProcessConfig, InProcessSystem

LAYER = "model.layers.{}.self_attn.attn"
F32 = torch.float32
ROOT = Path(__file__).resolve().parents[2]
README_SERVE = re.compile(
    r"<!-- vllm-serve:start -->\s*```bash\n(.*?)```\s*<!-- vllm-serve:end -->", re.S)


def readme_commands() -> tuple[list[str], str]:
    """(the README's ``hkv up`` argv, its ``vllm serve`` command line as one shell string)."""
    m = README_SERVE.search((ROOT / "README.md").read_text())
    assert m, "README.md lost its vllm-serve markers"
    lines = m.group(1).replace("\\\n", " ").splitlines()
    up = [ln for ln in lines if ln.startswith(".venv-vllm/bin/hkv up ")]
    serve = [ln for ln in lines if ln.startswith(".venv-vllm/bin/vllm serve ")]
    assert len(up) == 1 and len(serve) == 1, lines
    argv = shlex.split(up[0])
    if argv[-1] == "&":
        argv.pop()
    return argv, re.sub(r"\s+", " ", serve[0]).strip()


def write_tiny_config(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY))
    return path


def transfer_config(system: str, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="HkvConnector", kv_connector_module_path="hkv_service.connectors.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"system": system, **extra})


def engine_config(model: Path, system: str, block_size: int = 16,
                  transfer: KVTransferConfig | None = None) -> VllmConfig:
    cfg = EngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                     block_size=block_size, max_model_len=2048,
                     kv_transfer_config=transfer or transfer_config(system),
                     enable_prefix_caching=True).create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core would resolve
    return cfg


def served_transfer(endpoint: str, ray_address: str, spec_out: str | None = None
                    ) -> KVTransferConfig:
    """The connector config of an engine served by a running ``hkv up``."""
    extra = {"endpoint": endpoint, "ray_address": ray_address}
    if spec_out:
        extra["spec_out"] = spec_out
    return KVTransferConfig(
        kv_connector="HkvConnector", kv_connector_module_path="hkv_service.connectors.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)


def spec_for(model: Path, specs: dict[str, KVCacheSpec], block_size: int = 16) -> Any:
    """The hkv cache spec the connector derives for :class:`Harness` (what ``hkv up --spec``
    must run for it)."""
    cfg = engine_config(model, "-", block_size)
    kvc = get_kv_cache_configs(cfg, [specs], [48 << 20])[0]
    return engine_geometry(cfg, kvc).spec


def hybrid_specs(block_size: int = 16) -> dict[str, KVCacheSpec]:
    """The tiny Llama's layers: sliding window 128 and full attention, alternating."""
    out: dict[str, KVCacheSpec] = {}
    for i in range(4):
        if i % 2 == 0:
            out[LAYER.format(i)] = SlidingWindowSpec(block_size=block_size, num_kv_heads=2,
                                                     head_size=32, dtype=F32, sliding_window=128)
        else:
            out[LAYER.format(i)] = FullAttentionSpec(block_size=block_size, num_kv_heads=2,
                                                     head_size=32, dtype=F32)
    return out


def full_specs() -> dict[str, KVCacheSpec]:
    return {LAYER.format(i): FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                                               dtype=F32) for i in range(2)}


def reference_specs() -> dict[str, KVCacheSpec]:
    """hkv's reference spec as DeepSeek-V4-style vLLM groups: compressed ratio 4 (block 64),
    its indexer, compressed ratio 128 (block 128), sliding window 128 (block 64). Widths are
    chosen so every page is 2048 bytes: vLLM then keeps these block sizes."""
    return {
        "model.layers.0.attn.c4": MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=32, dtype=F32, tokens_per_state=4),
        "model.layers.0.attn.indexer": MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=32, dtype=F32, tokens_per_state=4,
            cache_role=SparseCacheRole.INDEXER),
        "model.layers.1.attn.c128": MLAAttentionSpec(
            block_size=128, num_kv_heads=1, head_size=512, dtype=F32, tokens_per_state=128),
        "model.layers.2.attn.swa": SlidingWindowMLASpec(
            block_size=64, num_kv_heads=1, head_size=8, dtype=F32, sliding_window=128),
    }


def nemotron_h_specs(block_size: int = 160) -> dict[str, KVCacheSpec]:
    """A tiny Nemotron-H's layers (``M*M-``: Mamba2, attention, Mamba2, MLP) as vLLM 0.32.0
    specs them on CPU with prefix caching on (measured by ``qwen3next_facts.py family``):
    conv state (3, 384) bf16 then SSM state (8, 32, 64) fp32, 67,840 bytes, padded to the
    attention page; Mamba2 exports in-chunk checkpoints (one checkpoint block). That model
    fails at its first prefill on this CPU, so tests use these specs without a model."""
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=block_size, shapes=((3, 384), (8, 32, 64)),
                      dtypes=(torch.bfloat16, F32), page_size_padded=attn.page_size_bytes,
                      mamba_type=MambaAttentionBackendEnum.MAMBA2, mamba_cache_mode="align",
                      num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    return {"model.layers.0.mixer": mamba, "model.layers.1.mixer.attn": attn,
            "model.layers.2.mixer": mamba}


def recurrent_config(model: Path, block_size: int = 160, chunk: int = 320,
                     retention: int | None = 0, transfer: KVTransferConfig | None = None
                     ) -> VllmConfig:
    """An engine config in Mamba "align" mode (what the engine sets for a hybrid model with
    prefix caching), prefill chunks of ``chunk`` tokens, the given
    ``prefix_cache_retention_interval``."""
    cfg = EngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                     block_size=block_size, max_model_len=2048, max_num_batched_tokens=chunk,
                     kv_transfer_config=transfer, enable_prefix_caching=True,
                     prefix_cache_retention_interval=retention).create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core would resolve
    cfg.cache_config.mamba_cache_mode = "align"  # the hybrid model's config hook sets these
    cfg.cache_config.mamba_block_size = block_size
    return cfg


def recurrent_scheduler(model: Path, specs: dict[str, KVCacheSpec], block_size: int = 160,
                        chunk: int = 320, retention: int | None = 0,
                        transfer: KVTransferConfig | None = None
                        ) -> tuple[VllmConfig, KVCacheConfig, Scheduler]:
    """vLLM's Scheduler over ``specs`` in Mamba "align" mode (what the engine sets for a
    hybrid model with prefix caching), prefill chunks of ``chunk`` tokens, the given
    ``prefix_cache_retention_interval``; no model, no worker."""
    cfg = recurrent_config(model, block_size, chunk, retention, transfer)
    kvc = get_kv_cache_configs(cfg, [specs], [64 << 20])[0]
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    sb, hb = resolve_kv_cache_block_sizes(kvc, cfg)
    sched = Scheduler(cfg, generate_scheduler_kv_cache_config([kvc]),
                      StructuredOutputManager(cfg), block_size=sb, hash_block_size=hb)
    return cfg, kvc, sched


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def block_content(view: torch.Tensor, tokens: list[int], group: int, layer: int
                  ) -> torch.Tensor:
    """The stand-in forward's bytes for a block: a function of the tokens up to its end (and
    of the group and layer), pseudo-random so a disk tier cannot compress it (fault tests
    find a record's bytes in the LMDB file by its head)."""
    seed = xxhash.xxh64_intdigest(bytes(f"{tokens}|{group}|{layer}", "ascii"))
    gen = torch.Generator().manual_seed(seed)
    shape = view[0].shape
    if not view.dtype.is_floating_point:  # a recurrent layer's raw int8 page
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int64).to(view.dtype)
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 8 - 4).to(view.dtype)


@contextlib.contextmanager
def harnesses(model: Path, root: Path, tag: str) -> Iterator[Callable[..., Harness]]:
    """A factory of Harnesses under ``root`` (each its own data dir and Ray namespace), all
    closed on exit: the ``make`` fixture of the connector tests."""
    made: list[Harness] = []

    def build(specs: dict[str, KVCacheSpec] | None = None, **kw: Any) -> Harness:
        h = Harness(model, root / f"hkv{len(made)}", specs or hybrid_specs(),
                    f"{tag}-{root.name}-{len(made)}", **kw)
        made.append(h)
        return h

    try:
        yield build
    finally:
        for h in made:
            h.close()


class Harness:
    def __init__(self, model: Path, data_dir: Path, specs: dict[str, KVCacheSpec],
                 name: str, block_size: int = 16, pool_blocks: int = 1024,
                 partitions: int = 1, split: bool = False, cfg: VllmConfig | None = None,
                 served: KVTransferConfig | None = None) -> None:
        """``served``: the connectors reach a running ``hkv up`` (:func:`served_transfer`)
        instead of an in-process hkv (``self.system`` is then None)."""
        self.name = name
        self.cfg = cfg or engine_config(model, name, block_size, served)
        self.kvc = get_kv_cache_configs(self.cfg, [specs], [48 << 20])[0]
        self.cfg.cache_config.num_gpu_blocks = self.kvc.num_blocks
        self.geo = engine_geometry(self.cfg, self.kvc)
        self.system: Any = None
        if served is None:
            base = InProcessConfig(shards=2, blocks_per_group=pool_blocks,
                                   partitions=partitions)
            if split:  # every chain split across the partitions every 2 periods
                base = replace(base, state=replace(
                    base.state, range_blocks=2 * Layout(self.geo.spec).period))
            self.system = InProcessSystem(self.geo.spec, data_dir, base)
            systems.publish(name, self.system)
        sb, hb = resolve_kv_cache_block_sizes(self.kvc, self.cfg)
        self.sched = Scheduler(self.cfg, generate_scheduler_kv_cache_config([self.kvc]),
                               StructuredOutputManager(self.cfg), block_size=sb,
                               hash_block_size=hb)
        self.worker = HkvConnector(self.cfg, KVConnectorRole.WORKER, self.kvc)
        self.caches = allocate_kv_cache(self.kvc, torch.device("cpu"),
                                        self.cfg.cache_config.get_resolved_kv_cache_layout())
        self.worker.register_kv_caches(self.caches)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(hb, sha256)
        self.outputs: list[SchedulerOutput] = []
        self.recved: set[str] = set()  # requests whose load the worker reported done
        self.sent: set[str] = set()  # finished requests whose save the worker reported landed
        # a step starts once the probes asked in earlier steps were answered, and waits for
        # the ones it asks (an engine whose steps outlast a probe); False: steps never wait on
        # probes (a tight empty-step loop, hkv slower than the step's probe_step_wait_s)
        self.wait_probes = True
        self.probe_step_wait_s: float | None = None  # set: the steps' wait, and no drain
        self.step_share = 1e9  # the wait's share of the step before: here, the wait itself

    @property
    def connector(self) -> HkvConnector:
        c = self.sched.connector
        assert isinstance(c, HkvConnector)
        return c

    def close(self) -> None:
        if self.system is not None:
            systems.withdraw(self.name)
            self.system.close()

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        req = Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      None, block_hasher=self.hasher)
        self.sched.add_request(req)
        return req

    def forget_local(self) -> None:
        """Drop vLLM's own prefix cache: a fresh engine, as far as its hits go."""
        assert self.sched.reset_prefix_cache()

    def step(self) -> SchedulerOutput:
        side = self.connector.scheduler
        if side is not None:
            side.probe_step_wait_s = (30.0 if self.wait_probes else 0.0) \
                if self.probe_step_wait_s is None else self.probe_step_wait_s
            side.step_share = self.step_share
        if self.wait_probes and self.probe_step_wait_s is None and side is not None:
            assert side._lane.drain(30.0), "hkv probes still pending after 30 s"
        out = self.sched.schedule()
        self.outputs.append(out)
        self._forward(out)
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)  # type: ignore[arg-type]
        w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.recved |= res.finished_recving or set()
        self.sent |= res.finished_sending or set()
        ids = list(out.num_scheduled_tokens)
        kco = KVConnectorOutput(finished_sending=res.finished_sending,
                                finished_recving=res.finished_recving,
                                failed_recving=res.failed_recving, invalid_block_ids=errors)
        reqs = self.sched.requests
        sampled = [[] if r in reqs and reqs[r].num_computed_tokens < reqs[r].num_prompt_tokens
                   else [7] for r in ids]  # a chunk of a prompt samples nothing
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=kco)
        self.sched.update_from_output(out, mro)
        return out

    def run(self, max_steps: int = 50, wait_s: float = 30.0) -> list[SchedulerOutput]:
        """Step until vLLM holds no request, then until every save handed to hkv landed
        (saves and loads run off the step: a step that schedules nothing while some are in
        flight waits for them a little, as an engine polling them would). Bounded."""
        start = len(self.outputs)
        work = self.worker.worker
        assert work is not None
        deadline = time.monotonic() + wait_s
        steps = 0
        while self.sched.has_requests() and steps < max_steps:
            out = self.step()
            if out.total_num_scheduled_tokens:
                steps += 1
            elif time.monotonic() > deadline:
                break
            else:
                work.drain(0.05)
                time.sleep(0.001)  # as vLLM's engine loop after a step that ran nothing
        assert not self.sched.has_requests(), "requests still running"
        assert work.drain(max(0.0, deadline - time.monotonic())), "hkv transfers in flight"
        return self.outputs[start:]

    def _forward(self, out: SchedulerOutput) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            tokens = list(req.all_token_ids)
            block_ids = self.sched.kv_cache_manager.get_block_ids(req_id)
            for g in self.geo.groups:
                bs = g.block_size
                for k in range((end - n) // bs, (end + bs - 1) // bs):
                    b = block_ids[g.vllm_group][k]
                    if b == 0:
                        continue
                    upto = tokens[: min((k + 1) * bs, len(tokens))]
                    for li, layer in enumerate(g.layers):
                        view = self.caches[layer]
                        view[b].copy_(block_content(view, upto, g.vllm_group, li))

    def admit(self, req_id: str, max_steps: int = 10) -> SchedulerOutput:
        """Step until ``req_id`` is scheduled or its load handed over (its first step asks
        hkv's probe and schedules nothing for it); that step's output."""
        for _ in range(max_steps):
            out = self.step()
            meta = out.kv_connector_metadata
            if req_id in out.num_scheduled_tokens or (
                    isinstance(meta, HkvConnectorMetadata)
                    and any(j.req_id == req_id for j in meta.loads)):
                return out
        raise AssertionError(f"{req_id} not scheduled in {max_steps} steps")

    def scheduled(self, req_id: str) -> int:
        """Tokens vLLM computed for ``req_id`` in its first step that computed any."""
        for out in self.outputs:
            n = out.num_scheduled_tokens.get(req_id, 0)
            if n:
                return n
        raise AssertionError(f"{req_id} was never scheduled")

    def loads(self, req_id: str) -> list[Any]:
        return [job for out in self.outputs
                if isinstance(out.kv_connector_metadata, HkvConnectorMetadata)
                for job in out.kv_connector_metadata.loads if job.req_id == req_id]

    def expected(self, tokens: list[int], group: int, k: int, layer_index: int) -> torch.Tensor:
        g = self.geo.groups[group]
        view = self.caches[g.layers[layer_index]]
        return block_content(view, tokens[: (k + 1) * g.block_size], group, layer_index)
