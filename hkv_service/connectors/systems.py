"""The connector's handle to hkv: the metadata port (scheduler side) and a data plane (worker).

Production: the gRPC :class:`~hkv_service.client.MetadataClient` and
:class:`~workers.raylink.RayLink` s to the shard actors ``hkv up`` placed on the Ray cluster.
In process: a :class:`~workers.inprocess.InProcessSystem` (real shards, real LMDB tiers) that a
test or ``hkv bench vllm`` published under a name. vLLM builds connectors from a config that
must stay plain data, so a live object can only be named there; the name table below is that
seam and nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hkv_service.core.port import MetadataPort
from hkv_service.core.spec import CacheSpec
from workers.dataplane import DataPlane

from .config import ConnectorConfig
from .errors import BadConnectorConfig

__all__ = ["Factory", "System", "dataplane", "metadata", "publish", "published", "withdraw"]


@runtime_checkable
class System(Protocol):
    """What an in-process hkv offers (``workers.inprocess.InProcessSystem`` has it)."""

    meta: Any

    def dataplane(self, timeout_s: float = 10.0) -> DataPlane: ...


Factory = Callable[[CacheSpec], System]
_published: dict[str, System | Factory] = {}
_lock = threading.Lock()


def publish(name: str, system: System | Factory) -> None:
    """Make ``system`` reachable as ``kv_connector_extra_config={"system": name}``. A factory
    is called once, with the spec the first connector derives from its engine (so the spec
    the in-process hkv runs is the engine's by construction); later connectors share it."""
    with _lock:
        _published[name] = system


def published(name: str) -> System | None:
    """The system published (or made by the factory published) under ``name``."""
    with _lock:
        got = _published.get(name)
    return got if isinstance(got, System) else None


def withdraw(name: str) -> None:
    with _lock:
        _published.pop(name, None)


def _inprocess(name: str, spec: CacheSpec) -> System:
    with _lock:
        got = _published.get(name)
        if got is None:
            raise BadConnectorConfig("system", f"no in-process hkv is published as {name!r} in "
                                     "this process (vLLM must run in it: "
                                     "VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        if not isinstance(got, System):
            got = _published[name] = got(spec)
        return got


def metadata(cfg: ConnectorConfig, spec: CacheSpec) -> MetadataPort:
    if cfg.system is not None:
        port: MetadataPort = _inprocess(cfg.system, spec).meta
        return port
    from hkv_service.settings import TlsConfig
    from workers.local import connect

    tls = None
    if cfg.tls_ca or cfg.tls_cert:
        tls = TlsConfig(_read(cfg.tls_ca, "tls_ca"), _read(cfg.tls_cert, "tls_cert"),
                        _read(cfg.tls_key, "tls_key"), cfg.tls_server_name)
    token = _read(cfg.auth_token_file, "auth_token_file")
    assert cfg.endpoint is not None
    # one service, or its partitions in order (HOST:P0,HOST:P1 as hkv up prints them)
    return connect(cfg.endpoint, token.decode().strip() if token else None, cfg.timeout_s, tls)


def dataplane(cfg: ConnectorConfig, spec: CacheSpec) -> DataPlane:
    if cfg.system is not None:
        return _inprocess(cfg.system, spec).dataplane(timeout_s=cfg.timeout_s)

    from workers.attach import join_ray
    from workers.raylink import ray_links, shard_actors

    # with Ray's token, and such that hkv's Ray going away never ends the engine (it recomputes)
    join_ray(cfg.ray_address, cfg.ray_namespace)
    actors = shard_actors(cfg.ray_namespace, cfg.shards or None)
    if not actors:
        raise BadConnectorConfig("shards", f"no shard actors in Ray namespace "
                                 f"{cfg.ray_namespace!r} at {cfg.ray_address!r}: is hkv up?")
    return DataPlane(metadata(cfg, spec), ray_links(actors, cfg.ray_namespace), cfg.timeout_s)


def _read(path: str | None, key: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise BadConnectorConfig(key, f"cannot read {path}: {err.strerror}") from None
