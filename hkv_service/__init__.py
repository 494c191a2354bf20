"""hkv: a KV-cache state service for hybrid-attention LLM inference.

The pure core lives in :mod:`hkv_service.core` (no I/O). The gRPC server, client and CLI are
thin edges around it; Ray shard actors live in ``workers``, the LMDB disk tier in ``storage``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
