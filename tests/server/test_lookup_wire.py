"""Lookup replies built as bytes: the framing equals protobuf's own encoding, a memo's stored
encoding decodes to the match a walk gives, and over a live server a repeated lookup (memo
hit, reply copied from the stored bytes) answers exactly what the first one did."""

from __future__ import annotations

import grpc
import pytest
from svc_util import Live, commit_remote, hashes, register

from hkv_service.client import MetadataClient
from hkv_service.core.api import LookupRequest, Match
from hkv_service.core.ids import PackedHashes, ShardId
from hkv_service.core.memo import Memo
from hkv_service.core.state_view import CacheState
from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb
from hkv_service.server.replies import ReplyCache
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes
from hkv_service.wire import codec

N = 40  # long enough for the memo (>= 32 blocks)


def _view(m: Match) -> tuple[object, ...]:
    return (m.usable_tokens, m.matched_tokens, m.downgrades, m.lease_id,
            {k: (c.records, c.strides, c.shard_names) for k, c in m.columns.items()})


@pytest.fixture
def filled() -> tuple[CacheState, LookupRequest]:
    st = CacheState(default_spec())
    st.register_owner(ShardId("s0"), pools_for(st.layout, N + 8))
    hs = prompt_hashes(st.spec, N)
    # no tails near the end: the walk matches every hash (a memo is kept) but the match
    # shrinks back to an earlier tail, so the reply carries a downgrade too
    commit_prefix(st, hs, skip=frozenset((d, "c4.tail") for d in range(N - 4, N)))
    codec.install_encoder(st)
    return st, LookupRequest(PackedHashes.of(hs))


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 200_000])
def test_repeated_field_is_protobufs_encoding(size: int) -> None:
    items = [pb.Match(usable_tokens=7, lease_id=size), pb.Match(),
             pb.Match(handles=[pb.HandleColumn(group="g", records=b"r" * size)])]
    expected = pb.LookupBatchResponse(matches=items).SerializeToString()
    assert codec.repeated_field(1, [m.SerializeToString() for m in items]) == expected


def test_memo_keeps_the_encoded_match(filled) -> None:
    st, req = filled
    first = st.lookup(req)
    assert first.memo is None and 0 < first.usable_tokens < N * 64 and first.downgrades
    st.lookup(req)  # the memo is made
    third = st.lookup(req)
    assert third.memo is not None and third.memo.wire is not None
    reply = pb.LookupBatchResponse.FromString(third.memo.wire)
    assert _view(codec.decode_match(reply.matches[0])) == _view(first)
    assert codec.batch_reply([third]) is third.memo.wire  # answered as is, no copy
    assert codec.batch_reply([third]) == codec.batch_reply([first])
    assert codec.match_bytes(third) == codec.match_bytes(first)
    leased = st.lookup(LookupRequest(req.block_hashes, lease_ttl_s=5))
    assert leased.lease_id is not None and leased.memo is None  # the reply names the lease
    assert pb.Match.FromString(codec.match_bytes(leased)).lease_id == leased.lease_id


def test_live_repeated_lookup_answers_the_same(live: Live, client: MetadataClient) -> None:
    register(client)
    hs = hashes(N)
    commit_remote(client, hs)
    answers = [client.lookup(LookupRequest(hs)) for _ in range(4)]
    assert answers[0].usable_tokens == N * 64
    assert all(_view(a) == _view(answers[0]) for a in answers[1:])
    assert client.stats()["events"]["lookup_memo_hit"] == 2  # type: ignore[index]
    batch = client.lookup_many([LookupRequest(hs), LookupRequest(hs[:3])])
    assert _view(batch[0]) == _view(answers[0]) and batch[1].usable_tokens < N * 64
    streamed = next(iter(client.lookup_stream([[LookupRequest(hs)]])))
    assert _view(streamed[0]) == _view(answers[0])


def _raw_lookup(live: Live, request: pb.LookupBatchRequest) -> bytes:
    with grpc.insecure_channel(live.endpoint) as ch:
        call = ch.unary_unary("/hkv.v1.MetadataService/Lookup")
        reply: bytes = call(request.SerializeToString(), timeout=5)
        return reply


def test_replayed_reply_never_outlives_a_change(live: Live, client: MetadataClient) -> None:
    """The same request bytes again: answered from the reply cache while the memo stands,
    and afresh (a smaller match) right after an eviction on the path or an owner change."""
    register(client)
    hs = hashes(N)
    ids = commit_remote(client, hs)
    request = pb.LookupBatchRequest()
    codec.encode_lookup(LookupRequest(hs), request.requests.add())
    replies = [_raw_lookup(live, request) for _ in range(5)]
    assert len(set(replies)) == 1
    stats = client.stats()  # calls 3-5 answered by the memo (4 and 5 replayed from bytes)
    assert stats["lookups"]["hit"] == 5 and stats["events"]["lookup_memo_hit"] == 3  # type: ignore[index]
    client.evict(ids[(N // 2, "c4")])
    after = pb.LookupBatchResponse.FromString(_raw_lookup(live, request)).matches[0]
    assert after.usable_tokens < N * 64
    full = pb.LookupBatchResponse.FromString(replies[0]).matches[0]
    assert full.usable_tokens == N * 64
    # a new owner (the stride table grows): no replay of a reply made before it
    for _ in range(3):
        _raw_lookup(live, request)
    register(client, owner="s1", blocks=8)
    memo_hits = client.stats()["events"]["lookup_memo_hit"]  # type: ignore[index]
    again = pb.LookupBatchResponse.FromString(_raw_lookup(live, request)).matches[0]
    assert client.stats()["events"]["lookup_memo_hit"] == memo_hits  # type: ignore[index]
    assert again.usable_tokens == after.usable_tokens  # walked afresh, not replayed


def test_reply_cache_is_bounded() -> None:
    cache = ReplyCache(max_entries=2, max_bytes=1000)
    memo = Memo((b"", 0, 0, 0, True, (), 0), b"", None, None, None, 0)  # type: ignore[arg-type]
    for i in range(4):
        cache.put(bytes([i]) * 100, memo, b"r" * 100)
    assert len(cache) == 2 and cache.get(b"\x00" * 100) is None
    assert cache.get(b"\x03" * 100) == (memo, b"r" * 100)
    cache.put(b"big", memo, b"x" * 2000)  # over the byte bound: not kept
    assert cache.get(b"big") is None and cache.nbytes == 400
    other = b"\x03" * 99 + b"\x04"  # same length, another request: never its reply
    assert cache.get(other) is None


def test_an_answer_borrowed_from_the_stop_is_never_replayed(live: Live,
                                                            client: MetadataClient) -> None:
    """A question past a cached prefix is answered from the prefix's memo once the walk
    stopped at the miss; the same request bytes must still walk each time, so a block written
    past the stop lengthens the next answer (a replay of the stored reply would not)."""
    register(client)
    hs = hashes(N + 4)
    commit_remote(client, hs[:N])
    request = pb.LookupBatchRequest()
    codec.encode_lookup(LookupRequest(hs), request.requests.add())
    replies = [_raw_lookup(live, request) for _ in range(4)]
    assert len(set(replies)) == 1
    assert client.stats()["events"]["lookup_memo_hit"] == 2  # type: ignore[index]
    assert pb.LookupBatchResponse.FromString(replies[0]).matches[0].matched_tokens == N * 64
    commit_remote(client, hs)
    after = pb.LookupBatchResponse.FromString(_raw_lookup(live, request)).matches[0]
    assert after.matched_tokens == (N + 4) * 64
