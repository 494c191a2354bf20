"""The pure core of hkv: kinds, states, transitions, hashing, allocator, funnel, checks, and
the state view over them (``state_view.CacheState``, a facade over one owner per path).

Nothing in this package performs I/O or imports grpc, ray, lmdb or torch. Edges (the gRPC
server, Ray shard actors, the LMDB store) call into it through ``api`` (the boundary types)
and ``port`` (what each call does). Every module, in its layer order:
``docs/architecture.md``, "The core, module by module".
"""
