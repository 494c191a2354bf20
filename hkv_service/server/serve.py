"""``hkv serve``: flags -> config, then the server, metrics, owner expiry and signal handling.

Exit codes: 0 after a clean shutdown, 2 for bad flags (one sentence on stderr), 1 when the
port cannot be bound. Once bound it prints ``hkv serve: listening on HOST:PORT`` (flushed),
which launchers and tests wait for. SIGTERM/SIGINT: health NOT_SERVING first, then
``server.stop(grace)``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hkv_service.core.admission import AdmissionCap
from hkv_service.core.errors import InvalidInput, SpecError
from hkv_service.core.state_view import CacheState, StateConfig
from hkv_service.specs import resolve_spec

from .app import ServerConfig, Service, build_service
from .auth import TlsFiles
from .metrics import start_metrics

__all__ = ["UsageError", "config_from_args", "run_serve"]

log = logging.getLogger("hkv.serve")
EXPIRE_EVERY_S = 1.0
DRAIN_S = 0.5  # NOT_SERVING is visible this long before new RPCs are refused


class UsageError(Exception):
    """A flag value that cannot work; the message is one sentence for the user."""


@dataclass(frozen=True, slots=True)
class ServeConfig:
    server: ServerConfig
    state: StateConfig
    spec_path: str | None
    metrics_port: int
    grace_s: float


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _port(value: int, flag: str) -> int:
    if not 0 <= value <= 65535:
        raise UsageError(f"{flag} must be between 0 and 65535, got {value}")
    return value


def _readable(path: str | None, flag: str) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path} is not a readable file")
    return p


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    cert, key = _readable(args.tls_cert, "--tls-cert"), _readable(args.tls_key, "--tls-key")
    ca = _readable(args.tls_ca, "--tls-ca")
    if (cert is None) != (key is None):
        raise UsageError("--tls-cert and --tls-key must be given together")
    if cert is None or key is None:
        if ca is not None:
            raise UsageError("--tls-ca (mTLS) needs --tls-cert and --tls-key as well")
        return None
    return TlsFiles(cert, key, ca)


def _token(path: str | None) -> str | None:
    p = _readable(path, "--auth-token-file")
    if p is None:
        return None
    token = p.read_text().strip()
    if not token:
        raise UsageError(f"--auth-token-file {path} is empty")
    return token


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Validate every flag; raises UsageError with one sentence."""
    port = _port(args.port, "--port")
    metrics_port = _port(args.metrics_port, "--metrics-port")
    if args.grace_s < 0:
        raise UsageError(f"--grace-s must not be negative, got {args.grace_s}")
    if not args.heartbeat_timeout_s > 0:
        raise UsageError(f"--heartbeat-timeout-s must be > 0, got {args.heartbeat_timeout_s}")
    tls, token = _tls(args), _token(args.auth_token_file)
    if not _is_loopback(args.host) and tls is None and token is None:
        if not args.insecure:
            raise UsageError(
                f"refusing to bind non-loopback address {args.host} without TLS or an auth "
                "token; give --tls-cert/--tls-key or --auth-token-file, or --insecure")
        log.warning("binding %s without TLS or auth token (--insecure): anyone who can reach "
                    "it can change cache state", args.host)
    cns = tuple(n.strip() for n in (args.tls_allowed_cn or "").split(",") if n.strip())
    if cns and (tls is None or tls.ca is None):
        raise UsageError("--tls-allowed-cn needs mTLS: give --tls-ca with --tls-cert/--tls-key")
    server = ServerConfig(host=args.host, port=port, auth_token=token, tls=tls, allowed_cns=cns)
    if args.max_inflight_objects < 1 or args.max_inflight_bytes < 1:
        raise UsageError("--max-inflight-objects and --max-inflight-bytes must be at least 1")
    if args.lookup_memo_mib < 0:
        raise UsageError(f"--lookup-memo-mib must not be negative, got {args.lookup_memo_mib}")
    state = StateConfig(
        admission=AdmissionCap(args.max_inflight_objects, args.max_inflight_bytes),
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        memo_max_bytes=args.lookup_memo_mib << 20,
        segment_blocks=args.walk_segment_blocks,
    )
    return ServeConfig(server, state, args.spec, metrics_port, args.grace_s)


def _expire_loop(state: CacheState, stop: threading.Event) -> None:
    while not stop.wait(EXPIRE_EVERY_S):
        lost = state.expire_owners()
        if lost:
            log.warning("owners silent past the heartbeat timeout, marked lost: %s", lost)


def _start(cfg: ServeConfig) -> tuple[Service, Any]:
    try:
        spec = resolve_spec(cfg.spec_path)
    except SpecError as err:
        raise UsageError(f"--spec: {err}") from None
    try:
        state = CacheState(spec, cfg.state)
    except InvalidInput as err:  # a setting the spec cannot take (the segment size)
        raise UsageError(f"--walk-segment-blocks: {err}") from None
    service = build_service(cfg.server, state)
    metrics = (start_metrics(service.state, cfg.server.host, cfg.metrics_port)
               if cfg.metrics_port else None)
    service.server.start()
    return service, metrics


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        service, metrics = _start(cfg)
    except UsageError as err:
        sys.stderr.write(f"hkv serve: error: {err}\n")
        return 2
    except (RuntimeError, OSError) as err:
        sys.stderr.write(f"hkv serve: cannot bind {args.host}:{args.port}: {err}\n")
        return 1
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %s: health NOT_SERVING, stopping with %.1fs grace", signum, cfg.grace_s)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    expire = threading.Thread(target=_expire_loop, args=(service.state, done), daemon=True,
                              name="hkv-expire")
    expire.start()
    print(f"hkv serve: listening on {cfg.server.host}:{service.port}", flush=True)
    while not done.wait(0.5):
        pass
    service.set_serving(False)  # probes see NOT_SERVING before the port closes
    drain = min(DRAIN_S, cfg.grace_s / 2)
    time.sleep(drain)
    service.stop(cfg.grace_s - drain).wait(cfg.grace_s + 5.0)
    if metrics is not None:
        metrics.shutdown()
    log.info("stopped")
    return 0
