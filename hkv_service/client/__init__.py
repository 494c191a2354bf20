"""Python client of the hkv metadata service; returns the core's own types."""

from .client import MetadataClient, RetryPolicy, RpcFailed, TlsConfig, TransitionItem

__all__ = ["MetadataClient", "RetryPolicy", "RpcFailed", "TlsConfig", "TransitionItem"]
