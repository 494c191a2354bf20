"""hkv's KV event stream decoded with vLLM's own classes, through a real ``hkv up`` (issue 39).

``hkv up`` runs a hybrid spec holding every kind (compressed KV with its tail, sliding
window, indexer, recurrent state) with ``--kv-events-port``; a worker attached to it writes
a prompt through the shipped data plane (tokens noted by an Allocate that carries them), and
a SUB socket decodes every batch with ``vllm.distributed.kv_events.KVEventBatch``: each
BlockStored's hashes, parent, token ids, block size, medium, group, spec kind and window.
Then the subscriber drops its connection, the worker offloads blocks to the disk tier
(evicting their memory copies), and a replay from the next seq brings the DISK stores and
the CPU removals back, decoded the same way. Then the shard is SIGKILLed: every block it held
in memory is removed (owner loss, as the reaper buries them). Then the service is SIGKILLed:
hkv up restarts it, its stream has a new epoch opened by AllBlocksCleared, and the disk
copies the shard re-confirms are stored again.
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import ray
import yaml
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from hkv_service.client.client import MetadataClient
from hkv_service.core.states import Kind
from tests.workers.up_proc import Up
from workers.attach import attach
from workers.launcher import clear_stale_ray

ABI = {"dtype": "float32", "layout": "NHD", "head_shape": [1, 8], "kernel_version": "k1"}
SPEC = {"model_id": "hybrid-events", "hash_block_size": 64, "groups": [
    {"name": "c4", "kind": "COMPRESSED", "block_size": 64, "ratio": 4, "overlap": 4,
     "abi": ABI},
    {"name": "swa", "kind": "SWA", "block_size": 64, "window": 128, "abi": ABI},
    {"name": "idx", "kind": "INDEXER", "block_size": 64, "ratio": 4, "indexes": "c4",
     "abi": ABI},
    {"name": "gdn", "kind": "RECURRENT", "block_size": 64, "state_kind": "GDN", "layers": 2,
     "state": [{"shape": [4, 8], "dtype": "float32"}],
     "abi": {"dtype": "float32", "layout": "conv-then-ssm", "head_shape": [2],
             "kernel_version": "gdn-1"}}]}
KINDS = {Kind.COMPRESSED: "full_attention", Kind.SWA: "sliding_window", Kind.STATE: "mamba",
         Kind.TAIL: "unknown", Kind.INDEXER: "unknown"}
DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def _port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def _drain(sub: zmq.Socket[Any], quiet_s: float = 2.0) -> list[tuple[int, KVEventBatch]]:
    out, last = [], time.monotonic()
    while time.monotonic() - last < quiet_s:
        if sub.poll(100):
            _topic, seq, payload = sub.recv_multipart()
            out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
            last = time.monotonic()
    return out


def _replay(ctx: zmq.Context[Any], port: int, start: int) -> list[tuple[int, KVEventBatch]]:
    req = ctx.socket(zmq.DEALER)
    req.connect(f"tcp://127.0.0.1:{port + 1}")
    req.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while req.poll(10_000):
        _, _topic, seq, payload = req.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    req.close(0)
    return out


def test_vllm_decodes_every_kind_and_tier_through_hkv_up(tmp_path: Path) -> None:
    clear_stale_ray()
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    port = _port_pair()
    up = Up(tmp_path, tmp_path / "data", "--spec", str(tmp_path / "spec.yaml"),
            "--kv-events-port", str(port))
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        endpoint, ray_address = up.ready()
        hkv = attach(endpoint, ray_address=ray_address)
        lay = hkv.layout
        tokens = np.arange(100, 100 + 4 * 64)
        hashes = hkv.hashes(tokens)
        meta = MetadataClient(endpoint)
        meta.allocate(hashes, [], token_ids=tokens.tolist())  # the writer's tokens, noted
        blocks, tails = {}, {}
        for d in range(len(hashes)):
            for c in lay.attached[d % lay.period]:
                col = lay.columns[c]
                if col.kind is Kind.TAIL:
                    n = col.tail_tokens_at((d + 1) * 64)
                    tails[(d, col.name)] = (np.zeros(lay.object_bytes(c, d, tail_len=n),
                                                     np.uint8), n)
                else:
                    blocks[(d, col.name)] = np.zeros(lay.object_bytes(c, d), np.uint8)
        report = hkv.plane.write_prefix(hashes, blocks, tails)
        assert not report.failed, report.failed
        got = _drain(sub)
        events = [e for _, b in got for e in b.events]
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert len(stored) == len(blocks) + len(tails)
        seen_kinds = set()
        for e in stored:
            (h,) = e.block_hashes
            d = hashes.index(h)
            col = lay.columns[e.group_idx]
            seen_kinds.add(col.kind)
            assert e.medium == "CPU" and e.lora_id is None and e.lora_name is None
            assert e.block_size == 64 and e.token_ids == tokens[d * 64:(d + 1) * 64].tolist()
            assert e.parent_block_hash == (hashes[d - 1] if d else None)
            assert e.kv_cache_spec_kind == KINDS[col.kind]
            assert e.kv_cache_spec_sliding_window == (128 if col.kind is Kind.SWA else None)
        assert seen_kinds == {Kind.COMPRESSED, Kind.TAIL, Kind.SWA, Kind.INDEXER, Kind.STATE}
        last = got[-1][0]

        # the subscriber drops; the worker offloads depth 1's c4 and swa, memory evicted
        sub.close(0)
        slots = [(1, "c4"), (1, "swa")]
        picked = [report.handles[slot] for slot in slots]
        results = hkv.plane.offload(picked, evict_memory=True)
        assert all(r.ok for r in results), results
        time.sleep(2.0)
        replayed = _replay(ctx, port, last + 1)
        assert replayed and replayed[0][0] == last + 1  # nothing lost in between
        later = [e for _, b in replayed for e in b.events]
        disk = {(e.group_idx, e.block_hashes[0]) for e in later
                if isinstance(e, BlockStored) and e.medium == "DISK"}
        gone = {(e.group_idx, e.block_hashes[0]) for e in later
                if isinstance(e, BlockRemoved) and e.medium == "CPU"}
        want = {(lay.by_name[name], hashes[d]) for d, name in slots}
        assert want <= disk and want <= gone
        first = _replay(ctx, port, 0)[0][1]
        assert isinstance(first.events[0], AllBlocksCleared)  # the epoch opened with a clear

        # the shard is killed (Ray restarts it, empty): its owner is lost and every block it
        # held in memory is removed, as the reaper buries it
        in_memory = {(e.group_idx, e.block_hashes[0]) for e in stored} - gone
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)
        (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("shard-")]
        pid = int(ray.get(ray.get_actor(name, namespace="hkv").ping.remote(), timeout=30)["pid"])
        os.kill(pid, signal.SIGKILL)
        removed: set[tuple[int, Any]] = set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not in_memory <= removed:
            removed |= {(e.group_idx, e.block_hashes[0]) for _, b in _drain(sub, 1.0)
                        for e in b.events if isinstance(e, BlockRemoved) and e.medium == "CPU"}
        assert in_memory <= removed, in_memory - removed

        # the service is killed and restarted by hkv up: a new epoch, opened by a clear, then
        # the blocks the shards re-confirm (the disk copies) are stored again
        up.kill_service(up.service_pid())
        deadline, after = time.monotonic() + 120, []
        while time.monotonic() < deadline and not any(
                isinstance(e, BlockStored) for _, b in after for e in b.events):
            after += _drain(sub, quiet_s=1.0)
        assert after, "no batch from the restarted service"
        seq0, batch0 = after[0]
        assert seq0 >> 32 > last >> 32  # a new epoch, above the old one's seqs
        assert isinstance(batch0.events[0], AllBlocksCleared) or isinstance(
            _replay(ctx, port, 0)[0][1].events[0], AllBlocksCleared)
        again = {(e.group_idx, e.block_hashes[0]) for _, b in after for e in b.events
                 if isinstance(e, BlockStored) and e.medium == "DISK"}
        assert want <= again  # re-confirmed from the disk tier, stored again
        meta.close()
        hkv.close()
    finally:
        ctx.destroy(0)
        ray.shutdown()  # attach joined this hkv up's Ray: the next test's is another
        up.stop()



def test_the_connectors_blocks_carry_their_token_ids(tmp_path: Path) -> None:
    """vLLM's real Scheduler and the connector's both roles (``vllm_harness``) served by a real
    ``hkv up``: every BlockStored of a block the connector saved carries exactly that block's
    tokens (``block_size`` of them, ending at its hash block) and its parent's hash."""
    from vllm_harness import Harness, hybrid_specs, prompt, served_transfer, spec_for
    from vllm_harness import write_tiny_config as tiny

    from hkv_service.core.hashing import ExtraKeys, hash_blocks

    clear_stale_ray()
    model = tiny(tmp_path / "tiny")
    spec = spec_for(model, hybrid_specs())
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
    port = _port_pair()
    up = Up(tmp_path, tmp_path / "data", "--spec", str(tmp_path / "spec.yaml"),
            "--blocks-per-group", "256", "--kv-events-port", str(port))
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    h = None
    try:
        endpoint, ray_address = up.ready()
        h = Harness(model, tmp_path, hybrid_specs(), "events",
                    served=served_transfer(endpoint, ray_address))
        tokens = prompt(200, seed=3)
        h.add("A", tokens, max_tokens=3)
        h.run()
        stored = [e for _, b in _drain(sub) for e in b.events if isinstance(e, BlockStored)]
        hb = spec.hash_block_size
        hashes = hash_blocks(tokens, hb, ExtraKeys(spec.model_id))
        whole = len(tokens) // hb  # the finished request's whole blocks, all saved
        assert {e.block_hashes[0] for e in stored} == set(hashes[:whole])
        assert {e.group_idx for e in stored} == set(range(len(spec.groups)))
        for e in stored:
            (bh,) = e.block_hashes
            d = hashes.index(bh)
            end = (d + 1) * hb
            assert e.block_size % hb == 0 and e.block_size <= end
            assert e.token_ids == tokens[end - e.block_size:end], (d, e.group_idx)
            assert e.parent_block_hash == (hashes[d - 1] if d else None)
    finally:
        if h is not None:
            h.close()
        ray.shutdown()
        ctx.destroy(0)
        up.stop()


def test_a_real_engines_blocks_carry_their_token_ids(tmp_path: Path) -> None:
    """The same through a real ``vllm.LLM`` (model weights, forward, vLLM's engine core) in a
    subprocess, served by a real ``hkv up``."""
    from vllm_e2e import write_model
    from vllm_harness import hybrid_specs, spec_for

    from hkv_service.core.hashing import ExtraKeys, hash_blocks

    clear_stale_ray()
    model = write_model(tmp_path / "tiny")
    # what the engine derives (it refuses another): vLLM's CPU backend runs 32-token blocks
    spec = spec_for(model, hybrid_specs(32), block_size=32)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
    port = _port_pair()
    up = Up(tmp_path, tmp_path / "data", "--spec", str(tmp_path / "spec.yaml"),
            "--blocks-per-group", "256", "--kv-events-port", str(port))
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        endpoint, ray_address = up.ready()
        here = Path(__file__).parent
        env = dict(os.environ, PYTHONPATH=f"{here.parents[1]}:{here}", RAY_ADDRESS=ray_address,
                   HKV_SPEC_OUT=str(tmp_path / "engine-spec.yaml"))
        run = subprocess.run([sys.executable, str(here / "vllm_events.py"), str(model),
                              endpoint, ray_address], capture_output=True, text=True,
                             timeout=600, env=env, cwd=tmp_path)
        if run.returncode and (tmp_path / "engine-spec.yaml").exists():
            print("".join(difflib.unified_diff(
                (tmp_path / "spec.yaml").read_text().splitlines(True),
                (tmp_path / "engine-spec.yaml").read_text().splitlines(True))))
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["drained"] and got["saved_blocks"] > 0
        tokens = got["tokens"]
        stored = [e for _, b in _drain(sub) for e in b.events if isinstance(e, BlockStored)]
        hb = spec.hash_block_size
        hashes = hash_blocks(tokens, hb, ExtraKeys(spec.model_id))
        assert {e.block_hashes[0] for e in stored} == set(hashes[:len(tokens) // hb])
        for e in stored:
            (bh,) = e.block_hashes
            d = hashes.index(bh)
            end = (d + 1) * hb
            assert e.token_ids == tokens[end - e.block_size:end], (d, e.group_idx)
            assert e.parent_block_hash == (hashes[d - 1] if d else None)
    finally:
        ctx.destroy(0)
        up.stop()
