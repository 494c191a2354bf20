"""Health, reflection, token auth, TLS and mTLS on a real in-process server."""

from __future__ import annotations

import datetime
import ipaddress
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from svc_util import Live, Proc, start_live, start_serve

from hkv_service.client import MetadataClient, RpcFailed, TlsConfig
from hkv_service.core.errors import Unavailable
from hkv_service.server.app import SERVICE_NAME, ServerConfig
from hkv_service.server.auth import DEFAULT_EXEMPT, TlsFiles

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _health(endpoint: str, service: str = "", **kw: Any) -> int:
    with grpc.insecure_channel(endpoint) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp: Any = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5, **kw)
        return int(resp.status)


def test_health_serving_then_not_serving(live: Live) -> None:
    assert _health(live.endpoint) == health_pb2.HealthCheckResponse.SERVING
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _health(live.endpoint, "hkv.v1.MetadataService") == serving
    live.service.set_serving(False)
    assert _health(live.endpoint) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_reflection_lists_the_service(live: Live) -> None:
    with grpc.insecure_channel(live.endpoint) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"hkv.v1.MetadataService", "grpc.health.v1.Health"} <= names


@pytest.fixture
def token_live() -> Any:
    lv = start_live(ServerConfig(port=0, auth_token="s3cret-token"))
    yield lv
    lv.service.stop(0).wait()


def test_token_required(token_live: Live) -> None:
    for token in (None, "wrong"):
        with MetadataClient(token_live.endpoint, token=token) as c, \
                pytest.raises(RpcFailed) as info:
            c.stats()
        assert info.value.code == "UNAUTHENTICATED"
        assert "s3cret" not in str(info.value)
    with MetadataClient(token_live.endpoint, token="s3cret-token") as c:
        assert "gauges" in c.stats()
        assert list(c.watch(0, timeout_s=0.3)) == []  # streaming methods pass too
    with MetadataClient(token_live.endpoint, token="bad") as c, pytest.raises(RpcFailed):
        list(c.watch(0, timeout_s=0.3))
    # health and reflection stay exempt
    assert _health(token_live.endpoint) == health_pb2.HealthCheckResponse.SERVING


def _services(endpoint: str, **kw: Any) -> set[str]:
    with grpc.insecure_channel(endpoint) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=5, **kw))
    return {s.name for s in resp.list_services_response.service}


def _stats_raw(endpoint: str, **kw: Any) -> grpc.StatusCode:
    from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb
    from hkv_service.proto_gen.hkv.v1 import hkv_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as ch:
        stub = pb_grpc.MetadataServiceStub(ch)  # type: ignore[no-untyped-call]
        try:
            stub.Stats(pb.StatsRequest(), timeout=5, **kw)
        except grpc.RpcError as err:
            code: grpc.StatusCode = err.code()
            return code
    return grpc.StatusCode.OK


def test_health_and_reflection_are_exempt_from_the_token(token_live: Live) -> None:
    """DEFAULT_EXEMPT's intent: probes and tooling work without the token, nothing else does.
    Every service the server registers is either exempt (by a DEFAULT_EXEMPT prefix) and
    answers without a token, or is hkv's and refuses one."""
    ep = token_live.endpoint
    names = _services(ep)  # reflection itself, no token
    assert {SERVICE_NAME, "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    exempt = {n for n in names if any(f"/{n}/" == p for p in DEFAULT_EXEMPT)}
    assert exempt == names - {SERVICE_NAME}  # the prefixes name the registered services
    assert _health(ep) == health_pb2.HealthCheckResponse.SERVING
    assert _health(ep, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    wrong = (("authorization", "Bearer wrong"),)
    assert _health(ep, metadata=wrong) == health_pb2.HealthCheckResponse.SERVING
    assert _stats_raw(ep) is grpc.StatusCode.UNAUTHENTICATED
    assert _stats_raw(ep, metadata=wrong) is grpc.StatusCode.UNAUTHENTICATED
    assert _stats_raw(ep, metadata=(("authorization", "Bearer s3cret-token"),)) \
        is grpc.StatusCode.OK


def test_exemption_is_configurable() -> None:
    lv = start_live(ServerConfig(port=0, auth_token="s3cret-token", auth_exempt=()))
    try:
        with pytest.raises(grpc.RpcError) as health_err:
            _health(lv.endpoint)
        with pytest.raises(grpc.RpcError) as refl_err:
            _services(lv.endpoint)
        for err in (health_err.value, refl_err.value):
            assert err.code() is grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", "Bearer s3cret-token"),)
        assert _health(lv.endpoint, metadata=good) == health_pb2.HealthCheckResponse.SERVING
        assert SERVICE_NAME in _services(lv.endpoint, metadata=good)
    finally:
        lv.service.stop(0).wait()


def test_rejected_tokens_are_never_logged(token_live: Live,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    near = ("s3cret-token-x", "s3cret-toke", "S3CRET-TOKEN")
    for token in near:
        with MetadataClient(token_live.endpoint, token=token) as c, pytest.raises(RpcFailed):
            c.stats()
    text = caplog.text + " ".join(str(r.args) for r in caplog.records)
    assert "s3cret" not in text.lower()


def test_served_token_is_never_in_the_output(procs: list[Proc], tmp_path: Path) -> None:
    """`hkv serve` with a token: rejected calls (none, wrong, near-miss, on a stream) and an
    accepted one; neither the token nor a guess at it shows in stdout or stderr."""
    secret = "tok-9f1c2e7d-never-logged"
    (tmp_path / "token").write_text(secret + "\n")
    p = start_serve("--port", "0", "--metrics-port", "0", "--auth-token-file",
                    str(tmp_path / "token"))
    procs.append(p)
    ep = f"127.0.0.1:{p.port}"
    for token in (None, "wrong", secret[:-1], secret + "x"):
        with MetadataClient(ep, token=token) as c:
            with pytest.raises(RpcFailed) as err:
                c.stats()
            assert err.value.code == "UNAUTHENTICATED" and secret[:8] not in str(err.value)
            with pytest.raises(RpcFailed):
                list(c.watch(0, timeout_s=2.0))
    with MetadataClient(ep, token=secret) as c:
        assert "gauges" in c.stats()
    assert p.stop() == 0
    assert p.popen.stdout is not None and p.popen.stderr is not None
    out, err_text = p.popen.stdout.read(), p.popen.stderr.read()
    assert "stopped" in err_text  # the log really was captured
    assert secret[:8] not in out + err_text


# ---- TLS --------------------------------------------------------------------------------------

def _key() -> Any:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: Any, issuer: tuple[str, Any] | None, ca: bool = False) -> Any:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(obj: Any) -> bytes:
    if hasattr(obj, "private_bytes"):
        return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,  # type: ignore[no-any-return]
                                 serialization.NoEncryption())
    return obj.public_bytes(serialization.Encoding.PEM)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    ca = _cert("hkv-test-ca", ca_key, None, ca=True)
    out = {"ca": ca}
    for name in ("server", "client"):
        key = _key()
        out[f"{name}_key"] = key
        out[name] = _cert(f"hkv-{name}", key, ("hkv-test-ca", ca_key))
    paths = {}
    for name, obj in out.items():
        paths[name] = d / f"{name}.pem"
        paths[name].write_bytes(_pem(obj))
    return paths


def test_tls(pki: dict[str, Path]) -> None:
    lv = start_live(ServerConfig(port=0, tls=TlsFiles(pki["server"], pki["server_key"])))
    try:
        tls = TlsConfig(ca=pki["ca"].read_bytes())
        with MetadataClient(f"localhost:{lv.port}", tls=tls) as c:
            assert "gauges" in c.stats()
        with MetadataClient(lv.endpoint, timeout_s=1.0) as c, pytest.raises(Unavailable):
            c.stats()  # plaintext against a TLS port
    finally:
        lv.service.stop(0).wait()


def test_mtls_rejects_client_without_cert(pki: dict[str, Path]) -> None:
    files = TlsFiles(pki["server"], pki["server_key"], pki["ca"])
    lv = start_live(ServerConfig(port=0, tls=files))
    try:
        ca = pki["ca"].read_bytes()
        with MetadataClient(f"localhost:{lv.port}", tls=TlsConfig(ca=ca), timeout_s=1.0) as c, \
                pytest.raises(Unavailable):
            c.stats()
        full = TlsConfig(ca=ca, cert=pki["client"].read_bytes(),
                         key=pki["client_key"].read_bytes())
        with MetadataClient(f"localhost:{lv.port}", tls=full) as c:
            assert "gauges" in c.stats()
    finally:
        lv.service.stop(0).wait()


def test_mtls_common_name_authorisation(pki: dict[str, Path]) -> None:
    files = TlsFiles(pki["server"], pki["server_key"], pki["ca"])
    ca = pki["ca"].read_bytes()
    full = TlsConfig(ca=ca, cert=pki["client"].read_bytes(), key=pki["client_key"].read_bytes())
    allowed = start_live(ServerConfig(port=0, tls=files, allowed_cns=("hkv-client",)))
    denied = start_live(ServerConfig(port=0, tls=files, allowed_cns=("someone-else",)))
    try:
        with MetadataClient(f"localhost:{allowed.port}", tls=full) as c:
            assert "gauges" in c.stats()
        with MetadataClient(f"localhost:{denied.port}", tls=full) as c, \
                pytest.raises(RpcFailed) as err:
            c.stats()
        assert err.value.code == "PERMISSION_DENIED"
        creds = grpc.ssl_channel_credentials(ca, full.key, full.cert)
        with grpc.secure_channel(f"localhost:{denied.port}", creds) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            health = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes stay exempt
    finally:
        allowed.service.stop(0).wait()
        denied.service.stop(0).wait()
