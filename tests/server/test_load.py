"""Bounded load: 8 client threads x 250 mixed lookups/transitions; nothing lost, counters add up."""

from __future__ import annotations

import threading

from svc_util import Live, commit_remote, hashes, register

from hkv_service.client import MetadataClient
from hkv_service.core.api import LookupRequest, Params
from hkv_service.core.states import Event

THREADS, OPS = 8, 250


def test_mixed_load_loses_nothing(live: Live, client: MetadataClient) -> None:
    register(client, "s0", blocks=1024)
    prefixes = [hashes(4, seed=100 + t) for t in range(THREADS)]
    errors: list[BaseException] = []
    lookups = [0] * THREADS

    def worker(t: int) -> None:
        try:
            with MetadataClient(live.endpoint) as c:
                ids = commit_remote(c, prefixes[t])
                idx, kv = ids[(3, "idx")], ids[(3, "c4")]
                version = live.state.objects[kv].version
                for i in range(OPS):
                    if i % 5 == 4:  # a legal repeat: the indexer synced again, same version
                        c.transition(idx, Event.INDEXER_SYNC, Params(version=version))
                    else:
                        other = prefixes[(t + i) % THREADS]
                        m = c.lookup(LookupRequest(other))
                        assert m.usable_tokens in (0, 256)
                        lookups[t] += 1
                assert c.lookup(LookupRequest(prefixes[t])).usable_tokens == 256
                lookups[t] += 1
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:3]
    for hs in prefixes:  # every committed object is visible
        assert client.lookup(LookupRequest(hs)).usable_tokens == 256
    s = client.stats()
    total = sum(s["lookups"].values())  # type: ignore[attr-defined]
    assert total == sum(lookups) + THREADS
    objects_per_prefix = len(live.state.objects) // THREADS
    assert s["gauges"]["objects"] == THREADS * objects_per_prefix  # type: ignore[index]
    synced = s["transitions"]["INDEXER:INDEXER_SYNCED"]  # type: ignore[index]
    assert synced == THREADS * (4 + OPS // 5)
