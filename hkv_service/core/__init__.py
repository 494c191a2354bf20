"""The pure core of hkv: kinds, states, transitions, hashing, allocator, funnel, checks.

Nothing in this package performs I/O or imports grpc, ray, lmdb or torch. Edges (the gRPC
server, Ray shard actors, the LMDB store) call into it.
"""
