"""The KV event stream of a real service (issue 39): ZMQ PUB frames (topic, seq, payload) of
vLLM's KVEventBatch, a replay socket, a new epoch after a restart, token ids as the writer
supplied them, both event forms (tagged maps, and arrays read by position as llm-d does),
and the Resumable RPC. The vLLM-venv test decodes the same stream with vLLM's own classes
through `hkv up` (tests/connectors/test_kv_events_vllm.py)."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from hkv_service.client.client import MetadataClient
from hkv_service.core.api import AllocRequest, LookupRequest
from hkv_service.core.errors import InvalidInput
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.resumable import Stop, resumable
from hkv_service.core.states import Event
from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb
from hkv_service.server.kvevents import END_SEQ, epoch_of
from hkv_service.server.serve import RunningService, start_service
from hkv_service.settings import ServiceSettings
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for
from tests.helpers import free_port

S0, D0 = ShardId("s0"), ShardId("d0")


def _port_pair() -> int:
    """P with P and P + 1 free on 127.0.0.1 (the PUB and the replay socket)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two adjacent free ports")


def _start(port: int, form: str = "map", metrics: int = 0) -> RunningService:
    return start_service(ServiceSettings(port=0, kv_events_port=port, kv_events_form=form,
                                         grace_s=0.5, metrics_port=metrics))


class Sub:
    """A subscriber: SUB on the stream, REQ-like DEALER on the replay socket."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.port = port

    def batches(self, until: float = 5.0) -> Iterator[tuple[bytes, int, Any]]:
        deadline = time.monotonic() + until
        while time.monotonic() < deadline:
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                yield topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)

    def replay(self, start: int) -> list[tuple[int, Any]]:
        req = self.ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{self.port + 1}")
        req.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while req.poll(5000):
            _, topic, seq, payload = req.recv_multipart()
            if seq == END_SEQ:
                break
            assert topic == b"kv@hkv-p0@hkv"  # the partition's stream, named in its topic
            out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        req.close(0)
        return out

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def _events(sub: Sub, want: int, until: float = 5.0) -> list[tuple[int, Any]]:
    """(seq, event) pairs until ``want`` events came."""
    out: list[tuple[int, Any]] = []
    for _, seq, (_ts, events, rank) in sub.batches(until):
        assert rank == 0
        out += [(seq, e) for e in events]
        if len(out) >= want:
            break
    return out


@pytest.fixture
def port() -> int:
    return _port_pair()


def _client(run: RunningService) -> tuple[MetadataClient, Layout]:
    client = MetadataClient(run.address)
    layout = Layout(default_spec())
    client.register_owner(S0, {k: v for k, v in pools_for(layout, 64).items()})
    client.register_owner(D0, {})
    return client, layout


def _write(client: MetadataClient, layout: Layout, tokens: np.ndarray) -> dict[Any, int]:
    hashes = hash_blocks(tokens, layout.hash_block, ExtraKeys(default_spec().model_id))
    slots = [(d, layout.columns[c].name) for d in range(len(hashes))
             for c in layout.attached[d % layout.period]
             if layout.columns[c].kind.value in ("COMPRESSED", "SWA")]
    allocs = client.allocate(hashes, [AllocRequest(d, c) for d, c in slots],
                             token_ids=tokens.tolist())
    for a in allocs:
        client.transition(a.handle.object_id, Event.WRITE_DONE)
    return {s: int(a.handle.object_id) for s, a in zip(slots, allocs, strict=True)}


def test_stream_fields_replay_and_a_new_epoch_after_restart(port: int) -> None:
    run = _start(port)
    sub = Sub(port)
    try:
        client, layout = _client(run)
        time.sleep(0.3)  # the SUB's connection is up before anything is published
        tokens = np.arange(1000, 1000 + 4 * layout.hash_block, dtype=np.int32)
        ids = _write(client, layout, tokens)
        hashes = hash_blocks(tokens, layout.hash_block, ExtraKeys(default_spec().model_id))
        got = _events(sub, len(ids))
        stored = [e for _, e in got if e["type"] == "BlockStored"]
        assert len(stored) == len(ids)
        swa = layout.by_name["swa"]
        c128 = layout.by_name["c128"]
        for e in stored:
            (h,) = e["block_hashes"]
            d = hashes.index(h)
            col = layout.columns[e["group_idx"]]
            bs = col.group.block_size
            assert e["block_size"] == bs and e["medium"] == "CPU"
            assert e["token_ids"] == tokens[(d + 1) * 64 - bs:(d + 1) * 64].tolist()
            assert e["parent_block_hash"] == (hashes[d - bs // 64] if d >= bs // 64 else None)
            assert e["kv_cache_spec_kind"] == ("sliding_window" if e["group_idx"] == swa
                                               else "full_attention")
            assert e["kv_cache_spec_sliding_window"] == (128 if e["group_idx"] == swa else None)
        assert any(e["group_idx"] == c128 for e in stored)
        client.evict(ids[(1, "swa")])
        (seq, removed), = _events(sub, 1)
        assert removed == {"type": "BlockRemoved", "block_hashes": [hashes[1]], "medium": "CPU",
                           "group_idx": swa}

        # a dropped connection: whatever was published meanwhile comes back by replay
        sub.close()
        client.evict(ids[(3, "swa")])
        time.sleep(0.3)
        replayed = Sub(port).replay(seq)
        assert [s for s, _ in replayed] == [seq, seq + 1]
        assert replayed[1][1][1][0]["block_hashes"] == [hashes[3]]
        first = Sub(port).replay(0)[0]
        assert first[1][1] == [{"type": "AllBlocksCleared"}]  # the epoch opens with a clear
        epoch = epoch_of(seq)
        client.close()
    finally:
        run.close(0).wait(5)
    time.sleep(0.2)
    run = _start(port)  # a restart: same ports, a new epoch, opened by a clear
    try:
        (s, _ts_events), = [(s, r[1]) for s, r in Sub(port).replay(0)]
        assert epoch_of(s) > epoch and _ts_events == [{"type": "AllBlocksCleared"}]
    finally:
        run.close(0).wait(5)


def test_array_form_decodes_by_position_as_llm_d_does(port: int) -> None:
    metrics = free_port()
    run = _start(port, form="array", metrics=metrics)
    try:
        client, layout = _client(run)
        tokens = np.arange(7, 7 + 2 * layout.hash_block, dtype=np.int32)
        ids = _write(client, layout, tokens)
        client.evict(ids[(1, "swa")])
        time.sleep(0.3)
        events = [e for _, b in Sub(port).replay(0) for e in b[1]]
        assert events[0] == ["AllBlocksCleared"]
        stored = [e for e in events if e[0] == "BlockStored"]
        swa = next(e for e in stored if e[9] == layout.by_name["swa"] and e[2] is not None)
        # [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys,
        #  group_idx, spec kind, window]
        assert swa[4] == 64 and swa[6] == "CPU" and swa[10] == "sliding_window"
        assert swa[11] == 128 and swa[3] == tokens[64:].tolist()
        c4 = next(e for e in stored if e[9] == layout.by_name["c4"])
        assert c4[10] == "full_attention" and c4[11] is None
        removed = [e for e in events if e[0] == "BlockRemoved"]
        # [tag, hashes, medium, group_idx]
        assert removed == [["BlockRemoved", swa[1], "CPU", layout.by_name["swa"]]]
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics").read().decode()
        assert 'hkv_kv_events_total{what="replays"} 1.0' in text
        assert f'hkv_kv_events_total{{what="events"}} {float(len(events))}' in text
        client.close()
    finally:
        run.close(0).wait(5)


def test_resumable_rpc_is_the_connectors_answer(port: int) -> None:
    run = _start(port)
    try:
        client, layout = _client(run)
        spec = default_spec()
        tokens = np.arange(5, 5 + 6 * layout.hash_block, dtype=np.int32)
        hashes = hash_blocks(tokens, layout.hash_block, ExtraKeys(spec.model_id))
        commit_prefix(run.service.state, hashes[:4], S0)  # the served view, in process
        r = client.resumable(token_ids=tokens.tolist())
        assert (r.prompt_tokens, r.tokens, r.memory_tokens) == (384, 256, 256)
        assert r.stop is Stop.NOT_CACHED and r.lookups == 1
        assert r == client.resumable(hashes)
        assert r == resumable(run.service.state.lookup, hashes, layout)
        probe = client.lookup(LookupRequest(hashes, None, None, handles=False))
        assert r.tokens == probe.usable_tokens  # what the connector's probe is told
        both = pb.ResumableRequest(packed_hashes=b"".join(hashes), token_ids=b"\0" * 4)
        for bad in (both, pb.ResumableRequest(packed_hashes=b"x" * 15),
                    pb.ResumableRequest(token_ids=b"\0" * 5), pb.ResumableRequest()):
            with pytest.raises(InvalidInput):
                client._call("Resumable", bad, idempotent=True)
        client.close()
    finally:
        run.close(0).wait(5)


def test_each_partition_publishes_its_own_stream() -> None:
    base = _port_pair()
    while not all(_free(base + k) for k in range(4)):
        base = _port_pair()
    runs = [start_service(ServiceSettings(port=0, kv_events_port=base, partition=f"{i}/2",
                                          grace_s=0.5)) for i in range(2)]
    try:
        for i in range(2):  # partition i: PUB base + 2i, replay base + 2i + 1, topic p{i}
            (_seq, batch), = _replay_topic(base + 2 * i, b"kv@hkv-p%d@hkv" % i)
            assert batch[1] == [{"type": "AllBlocksCleared"}]
    finally:
        for run in runs:
            run.close(0).wait(5)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _replay_topic(port: int, want: bytes) -> list[tuple[int, Any]]:
    """A replay of the stream whose PUB is on ``port``, every frame's topic ``want``."""
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.connect(f"tcp://127.0.0.1:{port + 1}")
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    out = []
    while req.poll(5000):
        _, topic, seq, payload = req.recv_multipart()
        if seq == END_SEQ:
            break
        assert topic == want
        out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    ctx.destroy(0)
    return out


def test_allocate_with_a_wrong_token_count_is_refused_before_anything_is_allocated(
        port: int) -> None:
    run = _start(port)
    try:
        client, layout = _client(run)
        tokens = np.arange(5, 5 + 2 * layout.hash_block, dtype=np.int32)
        hashes = hash_blocks(tokens, layout.hash_block, ExtraKeys(default_spec().model_id))
        col = next(c.name for c in layout.columns if c.kind.value == "COMPRESSED")
        with pytest.raises(InvalidInput, match="token_ids hold"):
            client.allocate(hashes, [AllocRequest(0, col)], token_ids=tokens[:-1].tolist())
        # nothing was reserved: the same allocation goes through fresh
        (a,) = client.allocate(hashes, [AllocRequest(0, col)], token_ids=tokens.tolist())
        assert not a.existing
        client.close()
    finally:
        run.close(0).wait(5)
