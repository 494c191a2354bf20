"""An inference worker's one entry point to a running hkv: ``attach(endpoint, ray_address)``.

It connects to the metadata service (gRPC, with the token/TLS the service wants), joins the
Ray cluster ``hkv up`` runs on (:func:`join_ray`: the cluster going away does not end the
worker), finds the shard actors itself, and returns a
:class:`Worker` holding the metadata client and a :class:`~workers.dataplane.DataPlane` over
them, plus the few rules a worker otherwise has to get right by hand (how to hash a prompt,
where a lookup may resume). ``hkv up`` prints the ``attach(...)`` call for its system when it
is ready. A metadata-service outage never raises out of a worker's lookup, read or write: it is
a recompute (:mod:`workers.outage`).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from hkv_service.core.api import LookupRequest, Match
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash
from hkv_service.core.layout import Layout
from hkv_service.core.spec import CacheSpec
from hkv_service.settings import TlsConfig

from . import outage
from .dataplane import DataPlane
from .local import connect
from .raylink import NAMESPACE, ray_links, shard_actors

__all__ = ["GCS_LOSS_TOLERANCE_S", "GCS_RECONNECT_ENV", "Worker", "attach", "join_ray"]


@dataclass
class Worker:
    meta: Any  # a MetadataClient, or a PartitionedMetadata over the partitions' clients
    plane: DataPlane
    spec: CacheSpec
    layout: Layout

    def hashes(self, tokens: Sequence[int] | np.ndarray, lora: str | None = None,
               salt: str | None = None) -> list[BlockHash]:
        """hkv's chained hashes of the prompt's whole blocks (a partial last block has none)."""
        extra = ExtraKeys(self.spec.model_id, lora or "", salt or "")
        return hash_blocks(np.asarray(tokens), self.layout.hash_block, extra)

    def resume_point(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Where a lookup of this prompt may resume at most: the hashed tokens, and not the
        last token (the model must compute at least one token to give logits)."""
        n = len(tokens)
        return max(0, min(n - 1, n // self.layout.hash_block * self.layout.hash_block))

    def lookup(self, tokens: Sequence[int] | np.ndarray, lease_ttl_s: float = 5.0
               ) -> tuple[list[BlockHash], Match]:
        """The prompt's hashes and the funnel's answer for them (handles leased). While the
        metadata service is out (restarting, unreachable, silent) the answer is "reuse
        nothing", downgraded with ``outage.OUTAGE_REASON``: a recompute, never an error."""
        hashes = self.hashes(tokens)
        if not hashes:
            return hashes, Match(0, 0, ())
        req = LookupRequest(hashes, self.resume_point(tokens), lease_ttl_s=lease_ttl_s)
        return hashes, outage.lookup(self.meta, req)

    def close(self) -> None:
        self.meta.close()


def attach(endpoint: str, ray_address: str = "auto", *, token: str | None = None,
           tls: TlsConfig | None = None, namespace: str = NAMESPACE,
           timeout_s: float = 10.0) -> Worker:
    """Connect to the hkv at ``endpoint`` whose shards run on the Ray cluster at
    ``ray_address``. Raises RuntimeError with a sentence when no shard is found."""
    meta: Any = connect(endpoint, token, timeout_s, tls)  # HOST:PORT, or partitions: H:P0,H:P1
    try:
        spec = meta.get_spec()
        join_ray(ray_address, namespace)
        actors: dict[str, Any] = shard_actors(namespace)
        if not actors:
            raise RuntimeError(f"no hkv shard actors in Ray namespace {namespace!r} at "
                               f"{ray_address!r}: is `hkv up` running on that cluster?")
        plane = DataPlane(meta, ray_links(actors, namespace), timeout_s)
    except BaseException:
        meta.close()
        raise
    return Worker(meta, plane, spec, Layout(spec))


# Ray ends a process whose GCS stays unreachable this long: "Failed to connect to GCS within
# 60 seconds ... The program will terminate" (std::_Exit in its GCS client, no Python
# exception; Ray's default is 60 s). hkv up takes its local Ray down when it stops, so an
# engine that joined it would die with hkv. Ray reads the value from this variable when
# ray.init builds the core worker (a cluster's own _system_config still wins). 30 days, not
# more: the raylet multiplies it by 1000 in 32 bits, past 4,294,967 s it wraps.
GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
GCS_LOSS_TOLERANCE_S = 30 * 24 * 3600


def join_ray(address: str | None = "auto", namespace: str = NAMESPACE) -> None:
    """Join the Ray cluster at ``address`` as a client of hkv (``attach``, the vLLM
    connector): with Ray's token where a local ``hkv up`` runs Ray with token auth, without
    the cluster's worker logs, and such that the cluster's GCS going away (``hkv up`` stopped)
    does not end this process: its hkv calls fail then, and it recomputes. A process already
    in Ray is left as it is (its settings were fixed when it joined)."""
    if ray.is_initialized():
        return
    _token_auth_if_available()
    with _gcs_loss_tolerated(address), _fresh_ray_ids():
        ray.init(address=address, namespace=namespace, log_to_driver=False)


@contextlib.contextmanager
def _fresh_ray_ids() -> Iterator[None]:
    """Python's ``random`` reseeded from the OS for ``ray.init``, the caller's state given
    back after. Ray 2.60 draws its GCS subscriber ids from that generator, and an engine has
    seeded it (vLLM's ``--seed``, 0 by default): every replica subscribed under one id, their
    error subscribers' long polls displaced each other and spun (two idle ``vllm serve``
    replicas: 0.25 cores each, 0.7 in Ray's GCS). The caller's sequence goes on as if Ray
    had drawn nothing."""
    state = random.getstate()
    random.seed()
    try:
        yield
    finally:
        random.setstate(state)


@contextlib.contextmanager
def _gcs_loss_tolerated(address: str | None) -> Iterator[None]:
    """:data:`GCS_RECONNECT_ENV` set for ``ray.init`` only: processes started later (an
    engine's own workers) do not inherit it. Kept as it is when the user set it, and left
    unset when ``ray.init`` may start a cluster here (no address, ``"local"``): its GCS and
    raylet would inherit it."""
    if GCS_RECONNECT_ENV in os.environ or address in (None, "local"):
        yield
        return
    os.environ[GCS_RECONNECT_ENV] = str(GCS_LOSS_TOLERANCE_S)
    try:
        yield
    finally:
        os.environ.pop(GCS_RECONNECT_ENV, None)


def _token_auth_if_available() -> None:
    """A local Ray started by ``ray.init`` (``hkv up`` without ``--address``) turns Ray's token
    auth on and keeps the token in ``~/.ray/auth_token``; a process joining it must send that
    token, which Ray 2.60 does only if told to. Do what Ray does for its own local start: with
    ``RAY_AUTH_MODE`` unset and a token present, use it."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # another Ray: it decides itself
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
