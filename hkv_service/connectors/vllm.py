"""``HkvConnector``: hkv as a vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``).

vLLM loads it by name::

    --kv-transfer-config '{"kv_connector": "HkvConnector",
                           "kv_connector_module_path": "hkv_service.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"endpoint": "127.0.0.1:50051"}}'

and builds one per role: the scheduler's (:mod:`.scheduler`: probes, leases, plans) and each
worker's (:mod:`.worker`: bytes). Both derive hkv's cache spec from vLLM's KV-cache config
(:mod:`.geometry`) and refuse to start if the service runs another one. ``SupportsHMA`` keeps
vLLM's hybrid allocator on: every group (full, sliding window, compressed, indexer,
recurrent state) is its own hkv group, and a hit is what hkv's funnel certifies for all of
them at one position.
A recurrent (Mamba / GatedDeltaNet) group's states are saved only from vLLM's per-step
``boundary_state_offloads`` and each request's output names the boundary hkv certified
(``kv_transfer_params["hkv"]``, see :class:`.scheduler.Certified`).
The scheduler's probe (hashing and a leased lookup) runs on a lane of its own:
``get_num_new_matched_tokens`` answers None until it is answered, and vLLM schedules the other
requests meanwhile (:mod:`.scheduler`). A hit's load takes the probe's leased match, so the
step does not call hkv for it; only when vLLM takes another length, or the probe's lease may
have lapsed, is hkv asked inside the step (a leased lookup at allocation, which certifies the
load). On the worker
(:mod:`.worker`), ``wait_for_save`` only copies
the pages to save into a staging buffer, their write and commit run on a background lane, and a
finished request's blocks stay held (``request_finished`` returns a delay) until its save
landed. Loads are asynchronous to the scheduler, so a stale handle (or any failed read) becomes a
failed receive and vLLM recomputes; with one full-attention group the failed blocks are
reported as load errors instead and vLLM keeps the prefix before them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import vllm
import yaml
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import ConnectorConfig
from .errors import ConnectorError, SpecMismatch
from .geometry import Geometry, geometry_from
from .lane import shorten_gil_switch
from .plan import LoadJob, SaveJob
from .scheduler import SchedulerSide
from .stats import HkvStats
from .systems import dataplane, metadata
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HkvConnector", "HkvConnectorMetadata", "engine_geometry"]

log = logging.getLogger(__name__)
VLLM_MINOR = ".".join(vllm.__version__.split(".")[:2])
_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


@dataclass
class HkvConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """Scheduler -> worker, once per step."""

    loads: tuple[LoadJob, ...] = ()
    saves: tuple[SaveJob, ...] = ()


def engine_geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                    cfg: ConnectorConfig | None = None) -> Geometry:
    """The geometry (and so the hkv cache spec) the connector derives for this engine: what
    the hkv service must run (``hkv up --spec``; tests build their in-process hkv from it)."""
    if cfg is None:
        tc = vllm_config.kv_transfer_config
        cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config if tc else {"system": "-"})
    par = vllm_config.parallel_config
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        raise ConnectorError("the hkv connector serves tensor- and pipeline-parallel size 1 "
                             f"only, not TP {par.tensor_parallel_size} / PP "
                             f"{par.pipeline_parallel_size}")
    model = vllm_config.model_config
    model_id = cfg.model_id or model.served_model_name or model.model
    geo = geometry_from(kv_cache_config, str(model_id), VLLM_MINOR)
    if cfg.spec_out:
        Path(cfg.spec_out).write_text(yaml.safe_dump(geo.spec.to_dict(), sort_keys=False))
    return geo


class HkvConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        if tc.kv_load_failure_policy != "recompute":
            raise ConnectorError("the hkv connector needs kv_load_failure_policy 'recompute' "
                                 "in --kv-transfer-config: a stale hkv handle is recomputed, "
                                 f"not a failed request (got {tc.kv_load_failure_policy!r})")
        cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        self.geometry = engine_geometry(vllm_config, kv_cache_config, cfg)
        shorten_gil_switch(cfg.gil_switch_interval_s)  # both sides run lanes beside the step
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._errors: set[int] = set()  # this step's load errors, taken by vLLM once
        if role is KVConnectorRole.SCHEDULER:
            meta = metadata(cfg, self.geometry.spec)
            self._check_spec(meta.get_spec(), cfg)
            self.scheduler = SchedulerSide(self.geometry, meta, self.geometry.spec.model_id,
                                           cfg.lease_ttl_s, cfg.probe_wait_s,
                                           cfg.probe_step_wait_s)
        else:
            plane = dataplane(cfg, self.geometry.spec)
            self._check_spec(plane.layout.spec, cfg)
            self.worker = WorkerSide(self.geometry, plane, int(cfg.staging_mib * (1 << 20)),
                                     cfg.drain_s, cfg.save_min_sightings)

    def _check_spec(self, service: Any, cfg: ConnectorConfig) -> None:
        if service != self.geometry.spec:
            raise SpecMismatch(service.model_id, self.geometry.spec.model_id, cfg.spec_out)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return HkvStats(dict(data or {}))

    def _sched(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler-side call on a worker connector"
        return self.scheduler

    def _work(self) -> WorkerSide:
        assert self.worker is not None, "a worker-side call on a scheduler connector"
        return self.worker

    # -- scheduler side ---------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._sched().null_block = gpu_block_pool.null_block.block_id

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._sched().matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched().allocated(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        source = self._sched().source(request.request_id)
        if not num_external_tokens:
            return {}
        return {_SOURCES.get(source or "host", CacheHitSource.HOST): num_external_tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        spec = scheduler_output.scheduled_spec_decode_tokens
        scheduled = {r: n - len(spec.get(r, ())) for r, n in
                     scheduler_output.num_scheduled_tokens.items()}
        manager = self._kv_cache_manager
        assert manager is not None, "vLLM binds the KV-cache manager before scheduling"
        # recurrent states: only what vLLM hands off in this step (it clears this field
        # before the output reaches the workers, and drains the hand-offs every step)
        state = scheduler_output.kv_connector_block_state
        handoffs = state.boundary_state_offloads if state is not None else {}
        gone = set(scheduler_output.finished_req_ids) | set(
            scheduler_output.preempted_req_ids or ())
        loads, saves = self._sched().take_jobs(scheduled, manager.get_block_ids, handoffs, gone)
        return HkvConnectorMetadata(loads, saves)

    def on_new_request(self, request: Request) -> None:
        self._sched().added(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.failed_recving:
            self._sched().failed(set(connector_output.failed_recving))
        if connector_output.finished_recving:
            self._sched().received(set(connector_output.finished_recving))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().finished(request, block_ids)

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches, self._kv_cache_config.num_blocks)

    def _meta(self) -> HkvConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, HkvConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and meta.loads:
            self._work().load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a load is reported (get_finished) before vLLM schedules its request

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole blocks are staged after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        """Stage this step's saves (the copies out of vLLM's cache); they land off the step."""
        meta = self._meta()
        if meta is not None and meta.saves:
            self._work().save(meta.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = self._work().take(finished_req_ids)
        self._errors = out.error_blocks
        return KVConnectorTransferResults(out.sent, out.recved, out.failed)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.scheduler or self.worker
        return side.stats.take() if side is not None else None
