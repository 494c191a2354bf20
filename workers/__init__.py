"""hkv's Ray side: cache shard actors (torch block pools + the node's disk tier), the inference
workers' data-plane client, and the launcher behind ``hkv up``.

::

    ports      data-plane value types (outcomes, packed reads, commits); the metadata port
               the workers need is the core's (hkv_service.core.port.MetadataPort)
    tags       a disk record's 64-byte tag (where its object sits in the prefix tree)
    local      the port in-process (LocalMetadata); raylink: through a Ray actor
    pool       torch block pools: generations, stale checks, readiness, claims
    shm        a shard's host pools in one shared-memory segment (memfd) workers can map
    shared     SharedLink: a worker's reads (seqlock) and writes (claims) through the segment
    control    the claims' local socket (a round trip of tens of microseconds, not a Ray call)
    shard      ShardActor: write/read/offload/load, registration, heartbeats
    dataplane  DataPlane: lookup results -> bytes, prefixes -> shards; failures -> Recompute
    link       ShardLink: the seam to a shard (in-process link; raylink: the Ray link)
    inprocess  InProcessSystem: the real parts wired in one process
    launcher   start_system / System.stop (the CLI half, run_up, is hkv_service.up)
    budget     RestartBudget: restarts per time window (hkv up's service and shards)
    nodekey    the name of a node's disk tiers: the one its data dir holds (stable across runs)
"""
