"""A reference KV connector for tests, without hkv: what hkv's connector must do for a model
with recurrent (``MambaSpec``, align mode) groups, in the fewest lines that run in vLLM.

It keeps blocks in a process-global dict (engine and connector in one process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a second request after
``LLM.reset_prefix_cache()`` (a fresh engine as far as hits go) resumes from it. Objects::

    attention group g, block k   key (g, H(tokens[:(k+1)*bs]))  the block's page, per layer
    recurrent group g, boundary p key (g, H(tokens[:p]))        the state's bytes (conv, then
                                                                 SSM), per layer, without the
                                                                 page's padding

Save. Attention blocks positionally, in the ``wait_for_save`` of the step that completes
them. Recurrent states only from ``SchedulerOutput.kv_connector_block_state.
boundary_state_offloads`` (``{req: [(group, block_id, boundary_tokens)]}``), read on the
scheduler side in ``build_connector_meta`` (vLLM clears it before the workers see the output)
and copied in that step's ``wait_for_save``, after the forward that wrote the state. Align-mode
block tables are not append-only (interior ids become the null block), so positions are
never used for them.

Load. A hit at ``p`` needs every attention block below ``p`` and, for every recurrent group,
the state at exactly ``p``. vLLM allocates a recurrent group's block for the hit at index
``p // bs - 1`` (nulls before it): the state goes there. Loads are asynchronous (the request
waits a step); :data:`MODE` changes what is loaded, for negative controls:

    full             everything (the real thing)
    shorter          everything, at the second-longest complete hit (a legitimate shorter one)
    skip_recurrent   attention blocks only: the recurrent block keeps whatever it held
    zero_recurrent   attention blocks, and zeros for the states
    nothing          claim the hit, load nothing
    wrong_boundary   the state saved one block earlier (p - bs) in place of p's
    sync             full, but claimed as a synchronous load (done in the step that computes)
    off              no lookups (saves still happen)

:data:`LOG` records what the engine handed the connector (views, hand-offs, jobs) for the
facts script.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["LOG", "MODE", "STORE", "StateRefConnector", "reset"]

STORE: dict[tuple[int, bytes], bytes] = {}
MODE: dict[str, str] = {"load": "full"}
LOG: dict[str, list[Any]] = {"views": [], "steps": [], "handoffs": [], "loads": [], "saves": [],
                             "hits": []}


def reset() -> None:
    STORE.clear()
    for v in LOG.values():
        v.clear()


def key(tokens: Any) -> bytes:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()


@dataclass(frozen=True, slots=True)
class Copy:
    group: int
    key: bytes
    block_id: int
    zero: bool = False


@dataclass
class RefMeta(KVConnectorMetadata):
    loads: list[tuple[str, list[Copy]]] = field(default_factory=list)
    saves: list[Copy] = field(default_factory=list)
    sync: bool = False


class StateRefConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.groups = [(g.kv_cache_spec, list(g.layer_names))
                       for g in kv_cache_config.kv_cache_groups]
        self.lcm = max(s.block_size for s, _ in self.groups)
        self.views: dict[str, torch.Tensor] = {}
        self._probes: dict[str, tuple[int, int]] = {}  # req -> (local, hit)
        self._requests: dict[str, Request] = {}
        self._loads: list[tuple[str, list[Copy]]] = []
        self._recved: set[str] = set()
        self._step = 0

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def _recurrent(self, g: int) -> bool:
        return isinstance(self.groups[g][0], MambaSpec)

    def _bytes(self, g: int) -> int:
        """Bytes kept per layer: a recurrent group's state without the page's padding."""
        spec = self.groups[g][0]
        if isinstance(spec, MambaSpec):
            return int(spec.real_page_size_bytes)
        return int(spec.page_size_bytes)

    # -- scheduler side ---------------------------------------------------------------------

    def has(self, tokens: list[int], p: int) -> bool:
        """Whether a hit at ``p`` is complete: every attention block below it, and every
        recurrent group's state at exactly ``p``."""
        for g, (spec, _) in enumerate(self.groups):
            bs = spec.block_size
            ends = [p] if self._recurrent(g) else range(bs, p + 1, bs)
            if any((g, key(tokens[:e])) not in STORE for e in ends):
                return False
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        self._requests[request.request_id] = request
        if MODE["load"] == "off":
            return 0, False
        tokens = list(request.all_token_ids)
        top = (len(tokens) - 1) // self.lcm * self.lcm
        skip = MODE["load"] == "shorter"
        for p in range(top, num_computed_tokens, -self.lcm):
            if self.has(tokens, p):
                if skip:  # the longest complete hit passed over: the next one is taken
                    skip = False
                    continue
                self._probes[request.request_id] = (num_computed_tokens, p)
                LOG["hits"].append((request.request_id, num_computed_tokens, p))
                return p - num_computed_tokens, MODE["load"] != "sync"
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        probe = self._probes.pop(request.request_id, None)
        if not num_external_tokens or probe is None:
            return
        local, p = probe
        assert local + num_external_tokens == p, (local, num_external_tokens, p)
        tokens = list(request.all_token_ids)
        ids = blocks.get_block_ids()
        mode = MODE["load"]
        copies: list[Copy] = []
        for g, (spec, _) in enumerate(self.groups):
            bs = spec.block_size
            if self._recurrent(g):
                if mode in ("skip_recurrent", "nothing"):
                    continue
                at = p - bs if mode == "wrong_boundary" else p
                if (g, key(tokens[:at])) not in STORE:
                    continue
                # the hit's state block: vLLM put nulls before it, the state goes here
                copies.append(Copy(g, key(tokens[:at]), ids[g][p // bs - 1],
                                   zero=mode == "zero_recurrent"))
            elif mode != "nothing":
                copies += [Copy(g, key(tokens[: (k + 1) * bs]), ids[g][k])
                           for k in range(local // bs, p // bs)]
        LOG["loads"].append({"req": request.request_id, "local": local, "hit": p, "mode": mode,
                             "block_ids": [list(x) for x in ids],
                             "copies": [(c.group, c.block_id) for c in copies]})
        self._loads.append((request.request_id, copies))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        LOG["steps"].append({"step": self._step, "scheduled": dict(
            scheduler_output.num_scheduled_tokens)})
        meta = RefMeta(loads=self._loads, sync=MODE["load"] == "sync")
        self._loads = []
        manager = self._kv_cache_manager
        assert manager is not None
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(req_id)
            if req is None or n <= 0:
                continue
            end = req.num_computed_tokens + n  # not advanced yet: schedule() does it after
            tokens = list(req.all_token_ids)[:end]
            ids = manager.get_block_ids(req_id)
            for g, (spec, _) in enumerate(self.groups):
                if self._recurrent(g):
                    continue
                bs = spec.block_size
                for k in range(req.num_computed_tokens // bs, end // bs):
                    k_key = key(tokens[: (k + 1) * bs])
                    if (g, k_key) not in STORE:
                        meta.saves.append(Copy(g, k_key, ids[g][k]))
        state = scheduler_output.kv_connector_block_state
        offloads = state.boundary_state_offloads if state is not None else {}
        for req_id, entries in offloads.items():
            req = self._requests.get(req_id)
            for g, block_id, boundary in entries:
                LOG["handoffs"].append({
                    "step": self._step, "req": req_id, "group": g, "block_id": block_id,
                    "boundary": boundary,
                    "scheduled": scheduler_output.num_scheduled_tokens.get(req_id, 0),
                    "computed": req.num_computed_tokens if req is not None else None})
                if req is not None:
                    meta.saves.append(Copy(g, key(list(req.all_token_ids)[:boundary]),
                                           block_id))
        return meta

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.views = dict(kv_caches)
        base = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
        for name, t in kv_caches.items():
            LOG["views"].append({
                "layer": name, "shape": list(t.shape), "dtype": str(t.dtype),
                "stride": list(t.stride()), "storage_offset": int(t.storage_offset()),
                "shared_storage": len(base) == 1})

    def _page(self, layer: str, block_id: int, nbytes: int) -> torch.Tensor:
        return self.views[layer][block_id].reshape(-1).view(torch.uint8)[:nbytes]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RefMeta)
        for req_id, copies in meta.loads:
            for c in copies:
                n = self._bytes(c.group)
                data = np.frombuffer(STORE[(c.group, c.key)], dtype=np.uint8)
                for i, layer in enumerate(self.groups[c.group][1]):
                    src = torch.zeros(n, dtype=torch.uint8) if c.zero else \
                        torch.from_numpy(data[i * n : (i + 1) * n].copy())
                    self._page(layer, c.block_id, n).copy_(src)
            if not meta.sync:
                self._recved.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RefMeta)
        for c in meta.saves:
            if (c.group, c.key) in STORE:
                continue
            n = self._bytes(c.group)
            STORE[(c.group, c.key)] = b"".join(
                self._page(layer, c.block_id, n).numpy().tobytes()
                for layer in self.groups[c.group][1])
            LOG["saves"].append((c.group, c.block_id))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._recved = self._recved, set()
        return None, done or None
