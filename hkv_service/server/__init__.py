"""The gRPC edge of hkv: ``hkv.v1.MetadataService`` over the core's one ``CacheState``."""

from .app import ServerConfig, create_server

__all__ = ["ServerConfig", "create_server"]
