"""hkv's Ray side: cache shard actors (torch block pools + the node's disk tier), the inference
workers' data-plane client, and the launcher behind ``hkv up``.

::

    ports      MetadataPort (what workers need from the service) + data-plane value types
    local      the port in-process (LocalMetadata) or through a Ray actor (MetadataActor)
    pool       torch block pools: generations, stale checks, readiness
    shard      ShardActor: write/read/offload/load, registration, heartbeats
    dataplane  DataPlane: lookup results -> bytes, prefixes -> shards; failures -> Recompute
    launcher   start_system / System.stop / run_up
"""
