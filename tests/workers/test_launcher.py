"""workers/launcher.py and hkv_service/up.py: `hkv up` as a subprocess (endpoint printed, a
lookup served, SIGINT -> exit 0 and nothing left running), --config and flag validation, and
`hkv up --service-replicas 2` (issue 19): a prompt lives in its root's partition; one
partition's process SIGKILLed is restarted by hkv up on its port and rebuilt from the shard's
re-confirm of that partition only, while the other keeps answering the same hit."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from hkv_service.core.api import LookupRequest
from hkv_service.core.errors import HkvError
from hkv_service.core.partitions import partition_of_root
from tests.helpers import child_env as _env
from workers.attach import attach
from workers.launcher import clear_stale_ray


def _group_pids(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True,
                         check=True).stdout
    return [int(p) for p, g, st in (line.split()[:3] for line in out.splitlines())
            if int(g) == pgid and not st.startswith("Z")]


def test_hkv_up_serves_and_stops_cleanly(tmp_path: Path, w: Any) -> None:
    w.clear_stale_ray()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "up", "--port", "0", "--data-dir",
         str(tmp_path / "data"), "--blocks-per-group", "8", "--disk-budget-bytes",
         str(16 << 20)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        start_new_session=True, cwd=tmp_path)
    assert proc.stdout is not None
    endpoint, lines = None, []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.startswith("hkv up: endpoint "):
                endpoint = line.split()[-1]
                break
        assert endpoint, "\n".join(lines)
        assert any("shard(s) up" in ln for ln in lines)
        from hkv_service.client import MetadataClient

        with MetadataClient(endpoint) as client:
            match = client.lookup(LookupRequest(w.prompt(2, seed=1)))
            assert match.usable_tokens == 0
            assert client.stats()["gauges"]["owners_alive"] == 1  # type: ignore[index]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stdout.read()
        time.sleep(1.0)
        assert _group_pids(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if _group_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)



def test_clear_stale_ray_looks_in_rays_own_temp_dir(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray keeps the address of the cluster last started here under its temp dir (RAY_TMPDIR,
    else TMPDIR, else /tmp), not always /tmp/ray: a stale file there (a killed run's) is the
    one ``ray.init`` would try to join, and a file under /tmp/ray belongs to someone else."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    pointer = tmp_path / "ray" / "ray_current_cluster"
    pointer.parent.mkdir()
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        pointer.write_text(f"127.0.0.1:{live.getsockname()[1]}")
        assert not clear_stale_ray() and pointer.exists()  # its GCS answers: left alone
    with socket.socket() as s:  # a port nobody listens on: the GCS of a killed run
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    pointer.write_text(f"127.0.0.1:{dead}")
    assert clear_stale_ray() and not pointer.exists()

@pytest.mark.parametrize("text, needle", [
    ("bogus_key: 1\n", "unknown key 'bogus_key'"),
    ("- a\n- b\n", "must be a mapping"),
    ("blocks-per-group: 0\n", "--blocks-per-group must be a positive integer"),
    ("port: abc\n", "port must be an integer, got 'abc'"),
    ("insecure: 1\n", "insecure must be true or false"),
    ("host: 0.0.0.0\n", "refusing to bind non-loopback address 0.0.0.0"),
])
def test_bad_config_exits_2_with_a_sentence(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "up.yaml"
    cfg.write_text(text)
    res = subprocess.run([sys.executable, "-m", "hkv_service.cli", "up", "--config", str(cfg)],
                         capture_output=True, text=True, env=_env(), timeout=60)
    assert res.returncode == 2
    assert needle in res.stderr and res.stderr.count("\n") == 1


def test_config_file_values_apply_and_flags_win(tmp_path: Path) -> None:
    from hkv_service.cli import build_parser
    from hkv_service.settings import ServiceSettings
    from hkv_service.up import config_from_args
    from workers.launcher import serve_argv

    cfg = tmp_path / "up.yaml"
    cfg.write_text("blocks-per-group: 32\nport: 7000\ngrace_s: 2.5\nlookup-memo-mib: 0\n"
                   "heartbeat-timeout-s: 3\n")
    args = build_parser().parse_args(["up", "--config", str(cfg), "--port", "7100"])
    config = config_from_args(args)
    assert config.blocks_per_group == 32 and config.port == 7100
    assert config.grace_s == 2.5 and config.lookup_memo_mib == 0
    assert config.heartbeat_timeout_s == 3.0  # an int in YAML, a float setting
    argv = serve_argv(config)  # the spawned service gets the service settings whole
    assert ServiceSettings.from_argv(argv[argv.index("serve") + 1:]) == config.service()
    assert "--walk-segment-blocks" not in argv  # unset: the service picks its spec's default
    # a flag given at its default value still wins over the file
    args = build_parser().parse_args(["up", "--config", str(cfg), "--port", "50051"])
    assert config_from_args(args).port == 50051


@pytest.mark.parametrize("flags, needle", [
    (["--port", "70000"], "--port must be between 0 and 65535"),
    (["--host", "0.0.0.0"], "refusing to bind non-loopback address"),
    (["--lookup-memo-mib", "-1"], "--lookup-memo-mib must not be negative"),
    (["--address", "auto", "--host", "0.0.0.0"], "refusing to bind non-loopback address"),
    (["--walk-segment-blocks", "3"], "--walk-segment-blocks: segment_blocks must be 0"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.pem"],
     "--tls-cert /nonexistent.pem is not a readable file"),
    (["--tls-cert", "/etc/hostname", "--tls-key", "/etc/hostname", "--tls-ca", "/etc/hostname"],
     "give --tls-client-cert/--tls-client-key"),
    (["--spec", "/nonexistent.yaml"], "--spec: cannot read cache spec"),
])
def test_bad_service_flags_exit_2_before_ray_starts(flags: list[str], needle: str) -> None:
    """Regression (issue 17, item 8): hkv up started Ray, then waited a minute for a service
    that had refused its flags, and exited 1."""
    res = subprocess.run([sys.executable, "-m", "hkv_service.cli", "up", *flags],
                         capture_output=True, text=True, env=_env(), timeout=60)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and res.stderr.count("\n") == 1 and "ray:" not in res.stderr


def test_help_answers_with_every_setting() -> None:
    from hkv_service.settings import SystemSettings, flag_of

    res = subprocess.run([sys.executable, "-m", "hkv_service.cli", "up", "--help"],
                         capture_output=True, text=True, env=_env(), timeout=60)
    assert res.returncode == 0 and res.stderr == ""
    for f in SystemSettings.flag_fields():
        assert flag_of(f.name) in res.stdout, f.name


# -- hkv up --service-replicas 2 ----------------------------------------------------------------

_PARTITION_PID = re.compile(r"partition (\d+)/2 \(pid (\d+)\) listening")


def _until_ready(proc: subprocess.Popen[str]) -> tuple[list[str], str, str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if line.startswith("hkv up: worker: "):
            ray_address = line.split("ray_address=")[1].rstrip(")\n").strip("'\"")
            endpoint = next(ln.split()[-1] for ln in lines if ln.startswith("hkv up: endpoint"))
            return lines, endpoint, ray_address
    raise AssertionError("hkv up did not come up:\n" + "\n".join(lines))


def _usable(meta: Any, hashes: list[bytes]) -> int | None:
    try:
        return int(meta.lookup(LookupRequest(hashes)).usable_tokens)
    except HkvError:  # that partition is down (UNAVAILABLE) or restarting
        return None


def test_a_partition_killed_is_rebuilt_while_the_other_serves(tmp_path: Path, w: Any) -> None:
    w.clear_stale_ray()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "up", "--service-replicas", "2", "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--blocks-per-group", "64",
         "--disk-budget-bytes", str(16 << 20), "--heartbeat-timeout-s", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        start_new_session=True, cwd=tmp_path)
    worker = None
    try:
        lines, endpoint, ray_address = _until_ready(proc)
        pids = {int(m.group(1)): int(m.group(2))
                for ln in lines if (m := _PARTITION_PID.search(ln))}
        assert sorted(pids) == [0, 1], lines
        assert len(endpoint.split(",")) == 2
        worker = attach(endpoint, ray_address=ray_address)
        stats = worker.meta.stats()
        assert [p["partition"] for p in stats["partitions"]] == ["0/2", "1/2"]
        assert all(p["gauges"]["owners_alive"] == 1 for p in stats["partitions"])

        prompts: dict[int, list[bytes]] = {}
        seed = 0
        while len(prompts) < 2:
            hashes = w.prompt(6, seed=seed)
            prompts.setdefault(partition_of_root(hashes[0], 2), hashes)
            seed += 1
        for i, hashes in prompts.items():
            blocks, tails = w.prefix_payload(worker.layout, 6, seed=i)
            assert worker.plane.write_prefix(hashes, blocks, tails).ok
        hit = {i: _usable(worker.meta, h) for i, h in prompts.items()}
        assert all(v and v > 0 for v in hit.values()), hit

        os.kill(pids[1], signal.SIGKILL)
        others, back = [], None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            others.append(_usable(worker.meta, prompts[0]))
            back = _usable(worker.meta, prompts[1])
            if back == hit[1]:
                break
            time.sleep(0.2)
        assert back == hit[1], "partition 1 did not come back with its hit"
        assert others and all(v == hit[0] for v in others), others  # never a miss or an error
        stats = worker.meta.stats()
        part0, part1 = stats["partitions"]
        assert part0["events"].get("owner_lost", 0) == 0  # partition 0 never lost the shard
        assert part1["gauges"]["owners_alive"] == 1
        worker.close()
        worker = None
        ray.shutdown()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        time.sleep(1.0)
        assert _group_pids(proc.pid) == []
    finally:
        if worker is not None:
            worker.close()
        ray.shutdown()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if _group_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
