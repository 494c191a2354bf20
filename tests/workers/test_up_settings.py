"""Every service setting takes effect on every path that starts a metadata service.

The paths: ``hkv serve``, ``hkv up`` (a local Ray instance; the service is its ``hkv serve``
child) and ``hkv up --address`` (a ``ray start --head`` cluster this module starts on loopback
and stops; the service runs in a Ray actor). Real processes, no mocks.

Each path runs once with every setting away from its default (:func:`probe_flags`), and once
bare on 0.0.0.0 with ``--insecure``; bad values are refused with exit 2 before anything
starts. ``CHECKS`` says, for every field of :class:`ServiceSettings`, what shows it took
effect; a field added without a check fails ``test_every_setting_has_a_check``::

    host 0.0.0.0        the port is bound on 0.0.0.0 (/proc/net/tcp), gRPC and metrics alike
    port, metrics_port  the service and /metrics answer on exactly those ports
    TLS, mTLS, CNs      the handshake works with the CA and fails without it, in plaintext and
                        without a client certificate; a CN not allowed is PERMISSION_DENIED
    token               right certificate, no token: UNAUTHENTICATED
    spec                the service's spec is the file's (another model id)
    heartbeat timeout   owners silent past 2 s are marked lost; the shards (heartbeating
                        every 0.5 s, derived from it) stay alive
    admission caps      the second offload is refused, naming the caps
    max_owners          the owner past the bound is refused (RESOURCE_EXHAUSTED)
    lookup memo 0       a repeated long lookup is never answered from the memo
    walk segments       the state runs with the size asked (hkv_settings_info)
    grace_s             after the port closes, an open stream lasts about grace_s, not 5 s

For ``hkv up`` the shards and hkv up's own client reach the service with the same settings
(mTLS with --tls-client-cert, the token, --tls-server-name): the shard registers and stays
alive, and hkv up prints the endpoint only after that.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_pki import Pki

from hkv_service.client import MetadataClient, RetryPolicy, TlsConfig, TransitionItem
from hkv_service.core.api import AllocRequest, LookupRequest, Params
from hkv_service.core.errors import AdmissionRefused, HkvError, ResourceExhausted, Unavailable
from hkv_service.core.layout import Layout
from hkv_service.core.states import Event, Kind
from hkv_service.settings import ServiceSettings
from hkv_service.specs import default_spec
from hkv_service.testing import pools_for, prompt_hashes
from tests.helpers import ROOT, Lines, up_env
from tests.helpers import free_port as _free_port

RAY = str(Path(sys.executable).with_name("ray"))
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}  # the test cluster's own: see test_sigterm.py
_env = functools.partial(up_env, **NO_AUTH)  # a child of these tests: hkv up or Ray
PATHS = ("serve", "up", "up-address")
SPEC_MODEL = "settings-probe-model"
GRACE_S = 1.5
HEARTBEAT_S = 2.0
MEMO_BLOCKS = 40  # >= the memo's 32-block minimum
MAX_OWNERS = 3

# What shows each service setting took effect (the checks in _check_probe).
CHECKS = {
    "host": "gRPC and /metrics bound on 0.0.0.0; refused bare, allowed with --insecure",
    "port": "the service answers on the port given",
    "metrics_port": "/metrics answers on the port given",
    "spec": "get_spec() is the file's",
    "auth_token_file": "no token: UNAUTHENTICATED",
    "tls_cert": "TLS handshake with the CA works; plaintext and no CA fail",
    "tls_key": "(with tls_cert)",
    "tls_ca": "no client certificate: the handshake fails",
    "tls_allowed_cn": "a CN not allowed: PERMISSION_DENIED",
    "insecure": "0.0.0.0 without token/TLS serves, with the warning",
    "heartbeat_timeout_s": "a silent owner is lost within seconds; shards stay alive",
    "grace_s": "an open stream outlives the port by about grace_s",
    "max_inflight_objects": "the refusal names the object cap",
    "max_inflight_bytes": "the second offload is refused by the byte cap",
    "max_owners": "registering past the bound is refused",
    "lookup_memo_mib": "0: no memo hit on a repeated long lookup",
    "walk_segment_blocks": "hkv_settings_info shows the state's segment size",
    # hkv up sets each replica's own (--service-replicas; test_launcher.py runs two)
    "partition": "Stats and hkv_settings_info say the state's partition, 0/1 here",
    # 64: the probe's 40-block prompt fits one range, so a plain client's lookup is served
    "range_blocks": "Stats and hkv_settings_info say where the state splits chains, 64",
    # the KV event stream (issue 39): a replay from seq 0 on the port given + 1 returns the
    # epoch's opening batch
    "kv_events_port": "the replay socket on port + 1 answers with the epoch's first batch",
    "kv_events_host": "bound on 127.0.0.2 (a loopback address, not the default)",
    "kv_events_topic": "the frames carry the topic given, {partition} filled in",
    "kv_events_form": "array: the events come as arrays, tag first",
}


def test_every_setting_has_a_check() -> None:
    assert set(CHECKS) == {f.name for f in fields(ServiceSettings)}


# -- processes --------------------------------------------------------------------------------

def _start(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hkv_service.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), start_new_session=True, cwd=cwd)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@dataclass
class Cluster:
    address: str
    head: subprocess.Popen[str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A one-node Ray cluster on loopback (its own --temp-dir: no other ray.init joins it)."""
    gcs = _free_port()
    temp = tempfile.mkdtemp(prefix="hkvray-", dir="/tmp")  # short: ray's socket paths
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--port", str(gcs), "--node-ip-address",
         "127.0.0.1", "--include-dashboard=false", "--num-cpus", "2", "--temp-dir", temp,
         "--disable-usage-stats", "--ray-client-server-port", str(_free_port()),
         "--dashboard-agent-listen-port", str(_free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        start_new_session=True, cwd=tmp_path_factory.mktemp("head"))
    out = Lines(head, "Ray runtime started")
    try:
        out.wait(120)
        yield Cluster(f"127.0.0.1:{gcs}", head)
    finally:
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(30)
        _kill_group(head)
        shutil.rmtree(temp, ignore_errors=True)


@dataclass
class Running:
    """A started service, whichever path started it."""

    proc: subprocess.Popen[str]
    out: Lines
    port: int  # as bound
    shards: int  # owners that hkv up registered (0 for hkv serve)
    path: str

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def signal_stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stopped(self) -> int:
        code = self.proc.wait(90)
        self.out.thread.join(10)
        return code


@contextlib.contextmanager
def started(path: str, flags: list[str], up_flags: list[str], cwd: Path,
            address: str | None) -> Iterator[Running]:
    if path == "serve":
        argv, ready = ["serve", *flags], "listening on"
    else:
        extra = ["--address", address] if path == "up-address" and address else []
        argv, ready = ["up", *flags, *up_flags, *extra], "hkv up: endpoint "
    proc = _start(argv, cwd)
    out = Lines(proc, ready)
    try:
        line = out.wait(180)
        port = int(line.rsplit(":", 1)[1])
        yield Running(proc, out, port, 0 if path == "serve" else 1, path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        _kill_group(proc)


# -- what the kernel says is bound ----------------------------------------------------------

def _bound(port: int) -> set[str]:
    """Addresses listening on ``port`` (any process), IPv4-mapped and :: shown as IPv4."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for row in rows:
            local, state = row[1], row[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            words = [int(addr_hex[i:i + 8], 16) for i in range(0, len(addr_hex), 8)]
            addr = socket.inet_ntop(family, struct.pack(f"<{len(words)}I", *words))
            found.add("0.0.0.0" if addr == "::" else addr.removeprefix("::ffff:"))
    return found


# -- clients -----------------------------------------------------------------------------------

@dataclass
class Probe:
    """The files the probe run uses and the clients made from them."""

    pki: Pki
    token: str
    worker: tuple[Path, Path]  # a client certificate whose CN is allowed
    intruder: tuple[Path, Path]  # signed by the same CA, CN not allowed

    def tls(self, ca: bool = True, cert: tuple[Path, Path] | None = None) -> TlsConfig:
        pair = cert or self.worker
        return TlsConfig(self.pki.ca.read_bytes() if ca else None, pair[0].read_bytes(),
                         pair[1].read_bytes(), server_name="localhost")

    def client(self, endpoint: str, token: bool = True, tls: TlsConfig | str | None = "ok"
               ) -> MetadataClient:
        config = self.tls() if tls == "ok" else tls
        assert not isinstance(config, str)
        return MetadataClient(endpoint, token=self.token if token else None, tls=config,
                              timeout_s=5.0, retry=RetryPolicy(attempts=1))

    def channel(self, endpoint: str) -> grpc.Channel:
        ca, cert, key = (self.pki.ca.read_bytes(), self.worker[0].read_bytes(),
                         self.worker[1].read_bytes())
        return grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(ca, key, cert),
                                   options=[("grpc.ssl_target_name_override", "localhost")])


def probe_files(d: Path) -> tuple[Probe, list[str], list[str]]:
    """The probe's files, its service flags (every setting away from its default) and the
    flags only hkv up has (its own clients' credentials, a small shard)."""
    pki = Pki(d / "pki")
    server = pki.issue("hkv-server", names=("localhost",))  # no IP names: see server_name
    shard = pki.issue("hkv-shard")
    probe = Probe(pki, "settings-probe-token", pki.issue("hkv-worker"), pki.issue("intruder"))
    (d / "token").write_text(probe.token + "\n")
    spec = d / "spec.yaml"
    ref = (ROOT / "hkv_service" / "data" / "reference_spec.yaml").read_text()
    spec.write_text(ref.replace("model_id: hkv-reference-v1", f"model_id: {SPEC_MODEL}"))
    c4 = next(c for c in Layout(default_spec()).columns if c.name == "c4")
    flags = ["--host", "0.0.0.0", "--port", str(_free_port()),
             "--metrics-port", str(_free_port()), "--spec", str(spec),
             "--auth-token-file", str(d / "token"), "--tls-cert", str(server[0]),
             "--tls-key", str(server[1]), "--tls-ca", str(pki.ca),
             "--tls-allowed-cn", "hkv-worker,hkv-shard",
             "--heartbeat-timeout-s", str(HEARTBEAT_S), "--grace-s", str(GRACE_S),
             "--max-inflight-objects", "3", "--max-inflight-bytes", str(c4.nbytes * 3 // 2),
             "--max-owners", str(MAX_OWNERS),
             "--lookup-memo-mib", "0", "--walk-segment-blocks", "4", "--range-blocks", "64",
             "--kv-events-port", str(_free_port_pair()), "--kv-events-host", "127.0.0.2",
             "--kv-events-topic", "kv@probe-p{partition}@m", "--kv-events-form", "array"]
    up = ["--tls-client-cert", str(shard[0]), "--tls-client-key", str(shard[1]),
          "--tls-server-name", "localhost", "--data-dir", str(d / "data"),
          "--blocks-per-group", "64", "--disk-budget-bytes", str(16 << 20)]
    return probe, flags, up


def _free_port_pair() -> int:
    """P with P and P + 1 free on 127.0.0.2 (the KV event PUB and its replay socket)."""
    for _ in range(50):
        port = _free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.2", port))
                b.bind(("127.0.0.2", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports on 127.0.0.2")


def _check_kv_events(port: int, p: Problems) -> None:
    import msgspec
    import zmq

    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.2:{port + 1}")
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        frames = req.recv_multipart() if req.poll(10_000) else []
        p.expect("kv_events_port", len(frames) == 4, f"replay answered {frames!r}")
        p.expect("kv_events_host", bool(frames), "nothing answers on 127.0.0.2")
        if len(frames) == 4:
            p.expect("kv_events_topic", frames[1] == b"kv@probe-p0@m", f"topic {frames[1]!r}")
            events = msgspec.msgpack.decode(frames[3])[1]
            p.expect("kv_events_form", events[0] == ["AllBlocksCleared"], f"events {events!r}")
    finally:
        ctx.destroy(0)


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


# -- the checks ------------------------------------------------------------------------------

class Problems(list[str]):
    def expect(self, setting: str, ok: object, why: str) -> None:
        assert setting in CHECKS, setting
        if not ok:
            self.append(f"{setting}: {why}")


def _fails(make: Callable[[], MetadataClient]) -> str:
    """How a stats call fails ('' if it does not)."""
    try:
        with make() as c:
            c.stats()
    except Unavailable:
        return "UNAVAILABLE"
    except HkvError as err:
        return str(getattr(err, "code", type(err).__name__))
    return ""


def _check_tls_and_token(run: Running, probe: Probe, p: Problems) -> None:
    ep = run.endpoint
    with probe.client(ep) as c:
        p.expect("tls_cert", "gauges" in c.stats(), "a client with the CA, its certificate and "
                                                   "the token cannot read stats")
    p.expect("tls_cert", _fails(lambda: probe.client(ep, tls=None)) == "UNAVAILABLE",
             "plaintext is not refused")
    p.expect("tls_cert", _fails(lambda: probe.client(ep, tls=probe.tls(ca=False)))
             == "UNAVAILABLE", "the handshake works without the CA")
    no_cert = TlsConfig(probe.pki.ca.read_bytes(), server_name="localhost")
    p.expect("tls_ca", _fails(lambda: probe.client(ep, tls=no_cert)) == "UNAVAILABLE",
             "a client without a certificate gets through (no mTLS)")
    denied = _fails(lambda: probe.client(ep, tls=probe.tls(cert=probe.intruder)))
    p.expect("tls_allowed_cn", denied == "PERMISSION_DENIED", f"CN 'intruder' got {denied!r}")
    unauth = _fails(lambda: probe.client(ep, token=False))
    p.expect("auth_token_file", unauth == "UNAUTHENTICATED", f"no token got {unauth!r}")


def _commit(c: MetadataClient, layout: Layout, hs: list[Any], owner: str) -> dict[Any, int]:
    """Allocate, write and sync a whole prefix through the client (as a shard would)."""
    reqs = [AllocRequest(d, layout.columns[k].name)
            for d in range(len(hs)) for k in layout.attached[d % layout.period]]
    allocs = c.allocate(hs, reqs, owner)
    first = []
    for r, a in zip(reqs, allocs, strict=True):
        if a.handle.kind is Kind.TAIL:
            need = layout.columns[a.handle.column].tail_tokens_at((r.depth + 1) * layout.hash_block)
            first.append(TransitionItem(a.handle.object_id, Event.TAIL_DONE, Params(tail_len=need)))
        else:
            first.append(TransitionItem(a.handle.object_id, Event.WRITE_DONE))
    done = c.transition_many(first)
    versions = {it.object_id: res.version for it, res in zip(first, done, strict=True)
                if not isinstance(res, Exception)}
    ids = {(r.depth, r.column): a.handle.object_id for r, a in zip(reqs, allocs, strict=True)}
    sync = [TransitionItem(a.handle.object_id, Event.INDEXER_SYNC, Params(
        version=versions[ids[(r.depth, layout.columns[layout.columns[a.handle.column].indexes
                                                      or 0].name)]]))
            for r, a in zip(reqs, allocs, strict=True) if a.handle.kind is Kind.INDEXER]
    assert not [x for x in c.transition_many(sync) if isinstance(x, Exception)]
    return ids


def _check_state(run: Running, probe: Probe, flags: list[str], p: Problems) -> float:
    """Spec, memo, admission; returns when the probe owner last beat (for the heartbeat)."""
    with probe.client(run.endpoint) as c:
        spec = c.get_spec()
        p.expect("spec", spec.model_id == SPEC_MODEL, f"model id {spec.model_id!r}")
        p.expect("partition", c.stats()["partition"] == "0/1",
                 f"Stats says partition {c.stats()['partition']!r}")
        p.expect("range_blocks", c.stats()["range_blocks"] == 64,
                 f"Stats says range_blocks {c.stats()['range_blocks']!r}")
        _check_kv_events(int(_flag(flags, "--kv-events-port")), p)
        layout = Layout(spec)
        owners = {"probe": c.register_owner("probe", pools_for(layout, 256))}
        stop = threading.Event()

        def beat() -> None:
            with probe.client(run.endpoint) as hb:
                while not stop.wait(0.3):
                    for name, inc in list(owners.items()):
                        with contextlib.suppress(HkvError):
                            hb.heartbeat(name, inc)

        beating = threading.Thread(target=beat, daemon=True)
        beating.start()
        try:
            hs = prompt_hashes(spec, MEMO_BLOCKS, seed=3)
            ids = _commit(c, layout, hs, "probe")
            for _ in range(3):
                c.lookup(LookupRequest(hs))
            events = c.stats()["events"]
            assert isinstance(events, dict)
            p.expect("lookup_memo_mib", not events.get("lookup_memo_hit"),
                     f"memo hits with --lookup-memo-mib 0: {events}")
            c.begin_offload(ids[(0, "c4")], "probe")
            refusal = ""
            try:
                c.begin_offload(ids[(1, "c4")], "probe")
            except AdmissionRefused as err:
                refusal = str(err)
            cap = _flag(flags, "--max-inflight-bytes")
            p.expect("max_inflight_bytes", f"/{cap} bytes" in refusal,
                     f"second offload not refused by the byte cap: {refusal!r}")
            p.expect("max_inflight_objects", "/3 objects" in refusal,
                     f"the refusal does not name the object cap 3: {refusal!r}")
            refused = ""
            for k in range(MAX_OWNERS):  # the shards and the probe hold some of the room
                try:
                    owners[f"extra-{k}"] = c.register_owner(f"extra-{k}", pools_for(layout, 8))
                except ResourceExhausted as err:
                    refused = str(err)
                    break
            p.expect("max_owners", f"{MAX_OWNERS} owners are registered" in refused
                     and len(owners) + run.shards == MAX_OWNERS,
                     f"{len(owners)} registered beside {run.shards} shard(s): {refused!r}")
        finally:
            stop.set()
            beating.join(5)
    return time.monotonic()


def _check_heartbeat(run: Running, probe: Probe, last_beat: float, p: Problems) -> None:
    """The probe's owners are lost well before the default 10 s; the shards are not."""
    silent = MAX_OWNERS - run.shards
    deadline = last_beat + 7.0
    with probe.client(run.endpoint) as c:
        while True:
            stats = c.stats()
            events, gauges = stats["events"], stats["gauges"]
            assert isinstance(events, dict) and isinstance(gauges, dict)
            if events.get("owner_lost", 0) >= silent or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    p.expect("heartbeat_timeout_s", events.get("owner_lost") == silent,
             f"the {silent} silent owner(s) not lost {time.monotonic() - last_beat:.1f}s "
             f"after their last heartbeat (events {events})")
    p.expect("heartbeat_timeout_s", gauges.get("owners_alive") == run.shards,
             f"owners alive {gauges.get('owners_alive')}, want the {run.shards} shard(s)")


def _check_metrics(run: Running, flags: list[str], p: Problems) -> None:
    metrics_port = int(_flag(flags, "--metrics-port"))
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=5).read().decode()
    except OSError as err:
        p.expect("metrics_port", False, f"/metrics on {metrics_port} does not answer: {err}")
        return
    info = next((ln for ln in body.splitlines() if ln.startswith("hkv_settings_info{")), "")
    p.expect("metrics_port", "hkv_objects " in body, "/metrics has no hkv_objects gauge")
    p.expect("walk_segment_blocks", 'walk_segment_blocks="4"' in info,
             f"the state's walk segment size is not 4: {info}")
    p.expect("host", _bound(metrics_port) == {"0.0.0.0"},
             f"/metrics bound on {_bound(metrics_port)}, not 0.0.0.0")
    p.expect("partition", 'partition="0/1"' in info, f"the state's partition is not 0/1: {info}")
    p.expect("range_blocks", 'range_blocks="64"' in info,
             f"the state does not split chains every 64 blocks: {info}")


def _stop_timing_grace(run: Running, probe: Probe, p: Problems) -> None:
    """Stop the path its way (SIGTERM) while a health stream is open: new calls are refused
    once the server stops; the stream is cut grace_s later."""
    ch = probe.channel(run.endpoint)
    stream: Any = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                        timeout=120)
    next(stream)
    ended = threading.Event()

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):
            for _ in stream:
                pass
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    run.signal_stop()
    closed = None
    deadline = time.monotonic() + 60
    while closed is None and time.monotonic() < deadline and not ended.is_set():
        with probe.channel(run.endpoint) as fresh:
            try:
                health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=1.0)
                time.sleep(0.05)
            except grpc.RpcError:
                closed = time.monotonic()
    ended.wait(30)
    cut = time.monotonic()
    ch.close()
    lasted = cut - closed if closed is not None else -1.0
    p.expect("grace_s", 0.4 <= lasted <= 3.2,
             f"the stream lasted {lasted:.2f}s after the port closed (grace {GRACE_S}s; the "
             "default would be about 5s)")


@pytest.mark.parametrize("path", PATHS)
def test_every_setting_takes_effect(path: str, tmp_path: Path, request: pytest.FixtureRequest,
                                    w: Any) -> None:
    address = request.getfixturevalue("cluster").address if path == "up-address" else None
    if path == "up":
        w.clear_stale_ray()
    probe, flags, up_flags = probe_files(tmp_path)
    p = Problems()
    with started(path, flags, up_flags, tmp_path, address) as run:
        p.expect("port", run.port == int(_flag(flags, "--port")),
                 f"bound port {run.port}, asked {_flag(flags, '--port')}")
        p.expect("host", _bound(run.port) == {"0.0.0.0"}, f"bound on {_bound(run.port)}")
        _check_tls_and_token(run, probe, p)
        _check_metrics(run, flags, p)
        last_beat = _check_state(run, probe, flags, p)
        _check_heartbeat(run, probe, last_beat, p)
        if path != "serve":
            shard_dirs = list((tmp_path / "data").glob("shard-*"))
            p.append("" if shard_dirs else "--data-dir: no shard folder under it")
        _stop_timing_grace(run, probe, p)
        code = run.stopped()
        p.append("" if code == 0 else f"exit {code} after SIGTERM")
    problems = [x for x in p if x]
    assert not problems, "\n".join(problems) + f"\n--- {path} output:\n" + run.out.text()


@pytest.mark.parametrize("path", PATHS)
def test_insecure_binds_any_address_with_a_warning(path: str, tmp_path: Path,
                                                   request: pytest.FixtureRequest,
                                                   w: Any) -> None:
    address = request.getfixturevalue("cluster").address if path == "up-address" else None
    if path == "up":
        w.clear_stale_ray()
    flags = ["--host", "0.0.0.0", "--insecure", "--port", "0"]
    up_flags = ["--data-dir", str(tmp_path / "data"), "--blocks-per-group", "8",
                "--disk-budget-bytes", str(16 << 20)]
    with started(path, flags, up_flags, tmp_path, address) as run:
        assert _bound(run.port) == {"0.0.0.0"}, _bound(run.port)
        with MetadataClient(run.endpoint) as c:
            gauges = c.stats()["gauges"]
        assert isinstance(gauges, dict) and gauges["owners_alive"] == run.shards
        if address is not None:  # a second hkv up with other settings must not take it over
            res = subprocess.run([sys.executable, "-m", "hkv_service.cli", "up", "--address",
                                  address, "--port", "0", *up_flags], capture_output=True,
                                 text=True, env=_env(), timeout=120, cwd=tmp_path)
            assert res.returncode == 1 and "already runs on this cluster with other settings" \
                in res.stderr, res.stdout + res.stderr
            with MetadataClient(run.endpoint) as c:
                assert c.stats()["gauges"]["owners_alive"] == 1  # type: ignore[index]
        run.signal_stop()
        assert run.stopped() == 0, run.out.text()
    assert "--insecure" in run.out.text(), run.out.text()


REFUSED = [
    (["--host", "0.0.0.0"], "refusing to bind non-loopback address 0.0.0.0"),
    (["--host", "::"], "refusing to bind non-loopback address ::"),
    (["--tls-allowed-cn", "w"], "--tls-allowed-cn needs mTLS"),
    (["--metrics-port", "70000"], "--metrics-port must be between 0 and 65535"),
    (["--heartbeat-timeout-s", "0"], "--heartbeat-timeout-s must be > 0"),
    (["--max-inflight-bytes", "0"], "--max-inflight-bytes must be a positive integer"),
    (["--grace-s", "-1"], "--grace-s must not be negative"),
    (["--walk-segment-blocks", "3"], "--walk-segment-blocks: segment_blocks must be 0"),
    (["--range-blocks", "3"], "--range-blocks: range_blocks must be 0"),
]


@pytest.mark.parametrize("path", PATHS)
def test_bad_settings_are_refused_before_anything_starts(path: str, tmp_path: Path) -> None:
    """Exit 2 with one sentence, before Ray (no 'hkv up: ray:' line), on every path: the auth
    guard holds for --address too (it bound 0.0.0.0 unauthenticated before)."""
    extra = {"serve": ["serve"], "up": ["up"],
             "up-address": ["up", "--address", "127.0.0.1:1"]}[path]
    for flags, needle in REFUSED:
        res = subprocess.run([sys.executable, "-m", "hkv_service.cli", *extra, *flags],
                             capture_output=True, text=True, env=_env(), timeout=60, cwd=tmp_path)
        assert res.returncode == 2, (flags, res.stderr, res.stdout)
        assert needle in res.stderr and res.stderr.count("\n") == 1, (flags, res.stderr)
        assert not re.search(r"ray:|listening", res.stdout + res.stderr), res.stdout
