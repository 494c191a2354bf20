"""TLS end to end (issue 17, item 3): ``hkv up --tls-cert/--tls-key`` on a local Ray instance
starts, its shards register over TLS, and ``hkv stats`` and ``System.metadata()`` (the demo's
client) reach it with the same TLS and token; bytes go through the shards and come back.

The service certificate is issued by a test CA and names 127.0.0.1: ``hkv stats`` trusts the
CA (``--tls-ca``); hkv up's own clients trust the service's certificate itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tls_pki import Pki

from hkv_service.core.api import LookupRequest
from tests.helpers import child_env as _env
from workers.dataplane import Recompute


def _files(d: Path) -> tuple[Pki, Path, Path, Path]:
    pki = Pki(d / "pki")
    cert, key = pki.issue("hkv-server", names=("localhost",), ips=("127.0.0.1",))
    token = d / "token"
    token.write_text("tls-e2e-token\n")
    return pki, cert, key, token


def _stats(endpoint: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hkv_service.cli", "stats", "--endpoint",
                           endpoint, "--json", *flags], capture_output=True, text=True,
                          env=_env(), timeout=60)


def test_hkv_up_with_tls_serves_shards_and_hkv_stats(tmp_path: Path, w: Any) -> None:
    pki, cert, key, token = _files(tmp_path)
    w.clear_stale_ray()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "up", "--port", "0", "--tls-cert", str(cert),
         "--tls-key", str(key), "--auth-token-file", str(token), "--data-dir",
         str(tmp_path / "data"), "--blocks-per-group", "8", "--disk-budget-bytes",
         str(16 << 20)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        start_new_session=True, cwd=tmp_path)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("hkv up: endpoint ") or "error" in line:
                break
        assert lines and lines[-1].startswith("hkv up: endpoint "), "\n".join(lines)
        endpoint = lines[-1].split()[-1]
        ok = _stats(endpoint, "--tls-ca", str(pki.ca), "--auth-token-file", str(token))
        assert ok.returncode == 0, ok.stderr
        gauges = json.loads(ok.stdout)["stats"]["gauges"]
        assert gauges["owners_alive"] == 1  # the shard registered and beats over TLS
        plain = _stats(endpoint, "--auth-token-file", str(token))
        assert plain.returncode == 1 and "does it want TLS (--tls-ca)" in plain.stderr
        no_token = _stats(endpoint, "--tls-ca", str(pki.ca))
        assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_system_metadata_and_dataplane_use_tls(tmp_path: Path, w: Any) -> None:
    from workers.launcher import SystemConfig, start_system

    _pki, cert, key, token = _files(tmp_path)
    w.clear_stale_ray()
    config = SystemConfig(port=0, tls_cert=str(cert), tls_key=str(key),
                          auth_token_file=str(token), data_dir=str(tmp_path / "data"),
                          blocks_per_group=16, disk_budget_bytes=16 << 20, device="cpu",
                          num_cpus=2, start_timeout_s=120.0)
    system = start_system(config)
    try:
        assert system.tls is not None and system.token == "tls-e2e-token"
        with system.metadata() as meta:
            assert meta.stats()["gauges"]["owners_alive"] == 1  # type: ignore[index]
        dp = system.dataplane()
        hashes = w.prompt(2, seed=5)
        blocks, tails = w.prefix_payload(dp.layout, 2, 5)
        assert dp.write_prefix(hashes, blocks, tails).ok
        match = dp.meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
        assert match.usable_tokens == 128
        out = dp.read(match, hashes)
        assert not isinstance(out, Recompute), out
        assert out["c4"][0].tobytes() == blocks[(0, "c4")].tobytes()
    finally:
        system.stop()
