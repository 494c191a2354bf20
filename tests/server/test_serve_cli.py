"""``hkv serve`` as a subprocess: flag checks, metrics, SIGTERM, and rebuild after kill -9."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_util import ROOT, Proc, commit_remote, hashes, register, serve_cmd, start_serve

from hkv_service.cli import build_parser
from hkv_service.client import MetadataClient, RetryPolicy, RpcFailed, TlsConfig
from hkv_service.core.api import LookupRequest, ObjectReport
from hkv_service.core.errors import Unavailable
from hkv_service.core.states import State
from tests.helpers import free_port as _free_port


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(serve_cmd(*args), capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(("args", "phrase"), [
    (("--host", "0.0.0.0", "--port", "0"), "refusing to bind non-loopback"),
    (("--port", "70000"), "--port must be between"),
    (("--grace-s", "-1"), "--grace-s must not be negative"),
    (("--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.pem"), "not a readable file"),
    (("--port", "abc"), "invalid int value"),
    (("--tls-allowed-cn", "worker"), "--tls-allowed-cn needs mTLS"),
    (("--max-inflight-objects", "0"), "--max-inflight-objects must be a positive integer"),
    (("--heartbeat-timeout-s", "0"), "--heartbeat-timeout-s must be > 0"),
    (("--auth-token-file", "/nonexistent-token"), "is not a readable file"),
    (("--tls-cert", "/etc/hostname"), "--tls-cert and --tls-key must be given together"),
    (("--lookup-memo-mib", "-1"), "--lookup-memo-mib must not be negative"),
    (("--walk-segment-blocks", "3"), "--walk-segment-blocks: segment_blocks must be 0 (off) "
                                     "or a positive multiple of 2"),
    (("--walk-segment-blocks", "-2"), "--walk-segment-blocks: segment_blocks must be 0"),
])
def test_bad_flags_exit_2_with_one_sentence(args: tuple[str, ...], phrase: str) -> None:
    out = _run(*args)
    assert out.returncode == 2, out.stderr
    assert phrase in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# The flags `hkv serve` must offer: ServiceSettings' fields, no other.
SERVE_FLAGS = (
    "--host", "--port", "--metrics-port", "--spec", "--auth-token-file",
    "--tls-cert", "--tls-key", "--tls-ca", "--tls-allowed-cn", "--insecure",
    "--heartbeat-timeout-s", "--grace-s", "--max-inflight-objects", "--max-inflight-bytes",
    "--max-owners", "--lookup-memo-mib", "--walk-segment-blocks", "--partition",
    "--range-blocks", "--kv-events-port", "--kv-events-host", "--kv-events-topic",
    "--kv-events-form",
)


def test_segment_default_is_the_cores() -> None:
    """The settings take the core's default from its import-free home (core/defaults.py)."""
    from hkv_service import settings
    from hkv_service.core.segments import DEFAULT_SEGMENT_BLOCKS
    assert settings.DEFAULT_SEGMENT_BLOCKS == DEFAULT_SEGMENT_BLOCKS


def test_settings_import_nothing_heavy() -> None:
    """``hkv --help`` imports the settings: they must not pull the core's heavy modules (numpy)
    in to read the defaults they share with it."""
    code = ("import sys, hkv_service.settings; "
            "print(sorted(m for m in sys.modules if m.startswith(('numpy', 'hkv_service'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == str(["hkv_service", "hkv_service.core", "hkv_service.core.defaults",
                               "hkv_service.settings"])


def _serve_parser_flags() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.choices and "serve" in a.choices)
    serve = sub.choices["serve"]  # type: ignore[index]
    return {o for a in serve._actions for o in a.option_strings}


def test_help_exits_0_and_mentions_every_flag() -> None:
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    flags = _serve_parser_flags()
    assert set(SERVE_FLAGS) | {"-h", "--help"} == flags
    for flag in flags:  # every flag the parser has, including any added later
        assert flag in out.stdout.split() or f"{flag}," in out.stdout or f"{flag} " in \
            out.stdout, flag
    assert "default 127.0.0.1" in out.stdout


def _listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs process ``pid`` listens on, from /proc (Linux)."""
    fd_dir = f"/proc/{pid}/fd"
    inodes = set()
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for row in rows:
            local, state, inode = row[1], row[3], row[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            words = [int(addr_hex[i:i + 8], 16) for i in range(0, len(addr_hex), 8)]
            packed = struct.pack(f"<{len(words)}I", *words)  # /proc prints host-order words
            found.add((_plain(socket.inet_ntop(family, packed)), int(port_hex, 16)))
    return found


def _plain(addr: str) -> str:
    """An IPv4-mapped IPv6 address as IPv4 (grpcio binds 127.0.0.1 as ::ffff:127.0.0.1), and
    the IPv6 wildcard as the IPv4 one (grpcio binds 0.0.0.0 dual-stack, as ::)."""
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return "0.0.0.0" if addr == "::" else addr


def test_default_host_binds_loopback_only(procs: list[Proc]) -> None:
    metrics_port = _free_port()
    p = start_serve("--port", "0", "--metrics-port", str(metrics_port))  # no --host
    procs.append(p)
    bound = _listening(p.popen.pid)
    assert {port for _, port in bound} >= {p.port, metrics_port}, bound
    assert {addr for addr, _ in bound} == {"127.0.0.1"}, bound  # gRPC and metrics alike
    with MetadataClient(f"127.0.0.1:{p.port}") as c:
        assert "gauges" in c.stats()
    assert p.stop() == 0


def _self_signed(d: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes as h
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hkv-serve-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(key, h.SHA256()))
    cert_path, key_path = d / "cert.pem", d / "key.pem"
    cert_path.write_bytes(cert.public_bytes(ser.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                           ser.NoEncryption()))
    return cert_path, key_path


@pytest.mark.parametrize("guard", ["token", "tls"])
def test_any_host_is_allowed_with_a_token_or_tls(procs: list[Proc], tmp_path: Path,
                                                 guard: str) -> None:
    if guard == "token":
        (tmp_path / "token").write_text("t0ken-for-any-host\n")
        flags: tuple[str, ...] = ("--auth-token-file", str(tmp_path / "token"))
    else:
        cert, key = _self_signed(tmp_path)
        flags = ("--tls-cert", str(cert), "--tls-key", str(key))
    p = start_serve("--host", "0.0.0.0", "--port", "0", "--metrics-port", "0", *flags)
    procs.append(p)
    assert ("0.0.0.0", p.port) in _listening(p.popen.pid)
    if guard == "token":
        with MetadataClient(f"127.0.0.1:{p.port}", token="t0ken-for-any-host") as c:
            assert "gauges" in c.stats()
        with MetadataClient(f"127.0.0.1:{p.port}") as c, pytest.raises(RpcFailed) as err:
            c.stats()
        assert err.value.code == "UNAUTHENTICATED"
    else:
        tls = TlsConfig(ca=cert.read_bytes())
        with MetadataClient(f"localhost:{p.port}", tls=tls) as c:
            assert "gauges" in c.stats()
        with MetadataClient(f"127.0.0.1:{p.port}", timeout_s=1.0) as c, \
                pytest.raises(Unavailable):
            c.stats()  # plaintext is refused
    assert p.stop() == 0
    assert p.popen.stderr is not None
    assert "--insecure" not in p.popen.stderr.read()  # guarded: no insecure-bind warning


def test_bad_spec_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "spec.yaml"
    bad.write_text("model_id: x\nhash_block_size: 0\ngroups: []\n")
    out = _run("--port", "0", "--spec", str(bad))
    assert out.returncode == 2 and "--spec" in out.stderr


def test_a_spec_whose_period_does_not_divide_64_serves_with_the_default(
        procs: list[Proc], tmp_path: Path) -> None:
    """Regression (issue 15, item 10): block sizes 64 and 96 (hash blocks of 32) repeat every
    6 hash blocks, and the default segment size 64 made ``hkv serve --spec`` exit 2. The
    default adapts to the period; only an explicit size it cannot take is an error."""
    import json

    abi = {"dtype": "float16", "head_shape": [2, 8]}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model_id": "m", "hash_block_size": 32, "groups": [
        {"name": "kv", "kind": "COMPRESSED", "block_size": 64, "ratio": 4, "overlap": 4,
         "abi": abi},
        {"name": "win", "kind": "SWA", "block_size": 96, "window": 192, "abi": abi}]}))
    p = start_serve("--port", "0", "--spec", str(spec))
    procs.append(p)
    with MetadataClient(f"127.0.0.1:{p.port}") as c:
        assert c.get_spec().lcm_block_size == 192
    assert p.stop() == 0
    out = _run("--port", "0", "--spec", str(spec), "--walk-segment-blocks", "64")
    assert out.returncode == 2 and "multiple of 6" in out.stderr


def test_insecure_allows_any_host_with_a_warning(procs: list[Proc]) -> None:
    metrics_port = _free_port()
    p = start_serve("--host", "0.0.0.0", "--port", "0", "--insecure",
                    "--metrics-port", str(metrics_port))
    procs.append(p)
    with MetadataClient(f"127.0.0.1:{p.port}") as c:
        register(c)
        commit_remote(c, hashes(2))
        c.lookup(LookupRequest(hashes(2)))
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    text = body.decode()
    assert 'hkv_lookups_total{result="hit"} 1.0' in text
    assert 'hkv_transitions_total{kind="COMPRESSED",state="COMPRESSED_READY"} 3.0' in text
    assert "hkv_in_transit_objects 0.0" in text and "hkv_objects " in text
    assert p.stop() == 0
    assert p.popen.stderr is not None and "--insecure" in p.popen.stderr.read()


def test_sigterm_sets_not_serving_first(procs: list[Proc]) -> None:
    p = start_serve("--port", "0", "--grace-s", "2")
    procs.append(p)
    seen: list[int] = []
    with grpc.insecure_channel(f"127.0.0.1:{p.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        stream = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        first = next(stream).status
        assert first == health_pb2.HealthCheckResponse.SERVING

        def read() -> None:
            try:
                for r in stream:
                    seen.append(r.status)
            except grpc.RpcError:
                pass

        t = threading.Thread(target=read)
        t.start()
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(15) == 0
        t.join(5)
    assert seen and seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    with MetadataClient(f"127.0.0.1:{p.port}", timeout_s=1.0) as c, pytest.raises(Unavailable):
        c.stats()  # new calls after shutdown: UNAVAILABLE (retryable), never a hang


def test_restart_rebuilds_only_from_confirmed_objects(procs: list[Proc]) -> None:
    p = start_serve("--port", "0")
    procs.append(p)
    port = p.port
    endpoint = f"127.0.0.1:{port}"
    hs_a, hs_b = hashes(4, seed=1), hashes(4, seed=2)
    client = MetadataClient(endpoint, retry=RetryPolicy(attempts=3, first_backoff_s=0.05))
    register(client, "s0")
    ids_a = commit_remote(client, hs_a, "s0")
    commit_remote(client, hs_b, "s0")
    # what the owner remembers of prefix A: every object's block and generation (versions
    # are the owner's: it reports each KV and its indexer at the same one)
    m_a = client.lookup(LookupRequest(hs_a))
    assert m_a.usable_tokens == 256
    p.stop(signal.SIGKILL)
    with pytest.raises(Unavailable):
        client.stats()
    p2 = start_serve("--port", str(port))
    procs.append(p2)
    deadline = time.monotonic() + 20
    while True:  # the client recovers once the port is back
        try:
            client.stats()
            break
        except Unavailable:
            assert time.monotonic() < deadline
    assert client.lookup(LookupRequest(hs_a)).usable_tokens == 0
    inc = register(client, "s0")
    assert client.lookup(LookupRequest(hs_a)).usable_tokens == 0  # registered, not confirmed
    by_id = {h.object_id: h for hs in m_a.handles.values() for h in hs}
    reports = []
    for (depth, column), oid in ids_a.items():
        h = by_id.get(oid)
        if h is None:  # not needed by a reader at 256 (e.g. early SWA blocks)
            continue
        state = {"c4": State.COMPRESSED_READY, "c128": State.COMPRESSED_READY,
                 "swa": State.SWA_VALID, "idx": State.INDEXER_SYNCED,
                 "c4.tail": State.TAIL_COMPLETE, "c128.tail": State.TAIL_COMPLETE}[column]
        lo, hi = (depth * 64, depth * 64 + 64) if column == "swa" else (0, 0)
        if column.endswith(".tail"):
            hi = 4 if column == "c4.tail" else 0
        reports.append(ObjectReport(hs_a[depth], hs_a[depth - 1] if depth else None, depth,
                                    column, state, h.block, h.generation, depth + 1, lo, hi))
    assert client.confirm("s0", reports, inc) == len(reports)
    assert client.lookup(LookupRequest(hs_a)).usable_tokens == 256  # confirmed: hits again
    assert client.lookup(LookupRequest(hs_b)).usable_tokens == 0  # never confirmed: miss
    client.close()
    assert p2.stop() == 0


def test_lookup_memo_flag_sizes_or_turns_off_the_memo() -> None:
    from hkv_service.cli import build_parser
    from hkv_service.core.api import LookupRequest as Req
    from hkv_service.core.state_view import CacheState
    from hkv_service.settings import ServiceSettings
    from hkv_service.specs import default_spec

    def state_of(*flags: str) -> CacheState:
        settings = ServiceSettings.from_args(build_parser().parse_args(["serve", *flags]))
        return CacheState(default_spec(), settings.state_config())

    assert state_of().memo.max_bytes == 64 << 20
    assert state_of("--lookup-memo-mib", "8").memo.max_bytes == 8 << 20
    off = state_of("--lookup-memo-mib", "0")
    assert off.memo.key(Req(hashes(40)), 40 * 64, 0) is None
