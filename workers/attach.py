"""An inference worker's one entry point to a running hkv: ``attach(endpoint, ray_address)``.

It connects to the metadata service (gRPC, with the token/TLS the service wants), joins the
Ray cluster ``hkv up`` runs on, finds the shard actors itself, and returns a
:class:`Worker` holding the metadata client and a :class:`~workers.dataplane.DataPlane` over
them, plus the few rules a worker otherwise has to get right by hand (how to hash a prompt,
where a lookup may resume). ``hkv up`` prints the ``attach(...)`` call for its system when it
is ready.
"""

from __future__ import annotations

from collections.abc import Sequence
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

from .dataplane import DataPlane
from .local import connect
from .raylink import NAMESPACE, ray_links, shard_actors

__all__ = ["Worker", "attach"]


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
        """The prompt's hashes and the funnel's answer for them (handles leased)."""
        hashes = self.hashes(tokens)
        if not hashes:
            return hashes, Match(0, 0, ())
        req = LookupRequest(hashes, self.resume_point(tokens), lease_ttl_s=lease_ttl_s)
        return hashes, self.meta.lookup(req)

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
        if not ray.is_initialized():
            _token_auth_if_available()
            ray.init(address=ray_address, namespace=namespace, log_to_driver=False)
        actors: dict[str, Any] = shard_actors(namespace)
        if not actors:
            raise RuntimeError(f"no hkv shard actors in Ray namespace {namespace!r} at "
                               f"{ray_address!r}: is `hkv up` running on that cluster?")
        plane = DataPlane(meta, ray_links(actors, namespace), timeout_s)
    except BaseException:
        meta.close()
        raise
    return Worker(meta, plane, spec, Layout(spec))


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
