"""`hkv up` stopped by SIGTERM or SIGINT, with real processes and no mocks.

Either signal drains: the service reports health NOT_SERVING before its port closes, shards and
the service are stopped, and (local mode) the Ray instance hkv up started is shut down. A
drained stop is a clean exit: ``hkv up`` returns 0, also when a second signal hurried it (1 is
kept for "the service died on its own"). Afterwards nothing it started is left: not ``hkv
serve`` (the bug: ray.init replaced the SIGTERM handler, ray's own handler exited without
stopping it, and it lived on under pid 1 with its port held), not a Ray process, and the
service port can be bound again. With ``--address`` the Ray cluster is not ours: it stays up,
but our service actor, shard actors and their worker processes are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers import Lines
from tests.helpers import free_port as _free_port
from tests.helpers import up_env as _env
from workers.raylink import NAMESPACE

RAY = str(Path(sys.executable).with_name("ray"))
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
EXIT_S = 60  # hkv up must have exited this long after the signal
GONE_S = 20  # ...and everything it started must be gone this long after that
# The test's own cluster runs without Ray's token auth: the default token (~/.ray/auth_token)
# is shared with every other ray.init on this machine, which may replace it meanwhile.
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


# -- processes, ports -------------------------------------------------------------------------

def _ps() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (ppid, pgid, stat, args), zombies left out."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,pgid=,stat=,args="], capture_output=True,
                         text=True, check=True).stdout
    rows: dict[int, tuple[int, int, str, str]] = {}
    for line in out.splitlines():
        parts = line.split(None, 4)
        if len(parts) < 4 or parts[3].startswith("Z"):
            continue
        rows[int(parts[0])] = (int(parts[1]), int(parts[2]), parts[3],
                               parts[4] if len(parts) > 4 else "")
    return rows


def _descendants(root: int) -> dict[int, str]:
    rows = _ps()
    kids: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, *_rest) in rows.items():
        kids[ppid].append(pid)
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        for child in kids[todo.pop()]:
            out[child] = rows[child][3]
            todo.append(child)
    return out


def _alive(procs: dict[int, str]) -> dict[int, str]:
    """The processes of ``procs`` still running (same pid and command line: no reuse)."""
    rows = _ps()
    return {p: a for p, a in procs.items() if p in rows and rows[p][3] == a}


def _group(pgid: int) -> dict[int, str]:
    return {p: r[3] for p, r in _ps().items() if r[1] == pgid}


def _wait_gone(procs: dict[int, str], timeout_s: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    left = _alive(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = _alive(left)
    return left


def _kill(procs: dict[int, str]) -> None:
    for pid in _alive(procs):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _port_held(port: int) -> bool:
    """Someone still listens on 127.0.0.1:port (TIME_WAIT left by closed connections does not
    count: SO_REUSEADDR; gRPC's SO_REUSEPORT listener does, since we do not set it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


# -- the processes under test ----------------------------------------------------------------

def start_up(tmp_path: Path, *extra: str, env: dict[str, str] | None = None
             ) -> tuple[subprocess.Popen[str], Lines]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "up", "--port", "0", "--data-dir",
         str(tmp_path / "data"), "--blocks-per-group", "8", "--disk-budget-bytes",
         str(16 << 20), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or _env(),
        start_new_session=True, cwd=tmp_path)
    return proc, Lines(proc, "hkv up: endpoint ")


class HealthWatch:
    """Streams the service's health (``Watch``) from before the signal until the port closes."""

    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        stub = health_pb2_grpc.HealthStub(self.channel)
        self.stream: Any = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
        self.first = next(self.stream).status
        self.seen: list[int] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for r in self.stream:
                self.seen.append(r.status)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(5)
        self.channel.close()


def _stop_up(proc: subprocess.Popen[str], tree: dict[int, str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    _kill(tree)
    _kill(_group(proc.pid))


def _named_actors(address: str) -> list[str]:
    """Named actors alive on the cluster at ``address``, from a driver of its own."""
    code = (f"import json, ray; ray.init(address={address!r}, log_to_driver=False); "
            "print('ACTORS ' + json.dumps([a['name'] for a in "
            "ray.util.list_named_actors(all_namespaces=True)])); ray.shutdown()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(**NO_AUTH), timeout=60)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("ACTORS ")), None)
    assert line, res.stdout + res.stderr
    names: list[str] = json.loads(line.removeprefix("ACTORS "))
    return names


def _check_drained(proc: subprocess.Popen[str], out: Lines, sigs: tuple[int, ...], port: int,
                   watch: HealthWatch, ours: dict[int, str]) -> list[str]:
    """Signal hkv up (its pid only; a second signal comes mid-drain) and list what went
    wrong."""
    for i, sig in enumerate(sigs):
        if i:
            time.sleep(0.3)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
    problems: list[str] = []
    try:
        code = proc.wait(EXIT_S)
    except subprocess.TimeoutExpired:
        return [f"hkv up still running {EXIT_S}s after {sigs}"]
    out.thread.join(10)
    if code != 0:
        problems.append(f"hkv up exited {code}, not 0")
    left = _wait_gone(ours, GONE_S)
    left |= _alive(_group(proc.pid))
    if left:
        problems.append("left running: " + "; ".join(f"{p} {a[:90]}" for p, a in left.items()))
    if _port_held(port):
        problems.append(f"service port {port} still held")
    watch.thread.join(5)
    if NOT_SERVING not in watch.seen:
        problems.append(f"health never went NOT_SERVING before the port closed: {watch.seen}")
    if not any(ln == "hkv up: stopped" for ln in out.lines):
        problems.append("hkv up did not say it stopped")
    return problems


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sigs", [(signal.SIGTERM,), (signal.SIGINT,),
                                  (signal.SIGTERM, signal.SIGINT)],
                         ids=["SIGTERM", "SIGINT", "SIGTERM-then-SIGINT"])
def test_local_up_drains_on_signal_and_leaves_nothing(tmp_path: Path, w: Any,
                                                      sigs: tuple[int, ...]) -> None:
    w.clear_stale_ray()
    proc, out = start_up(tmp_path)
    tree: dict[int, str] = {}
    watch = None
    try:
        endpoint = out.wait(120).split()[-1]
        port = int(endpoint.rsplit(":", 1)[1])
        tree = _descendants(proc.pid)
        serve = {p: a for p, a in tree.items() if "hkv_service.cli serve" in a}
        assert len(serve) == 1, tree
        assert any("raylet" in a for a in tree.values()), tree  # the Ray instance it started
        assert any("gcs_server" in a for a in tree.values()), tree
        watch = HealthWatch(endpoint)
        assert watch.first == SERVING
        problems = _check_drained(proc, out, sigs, port, watch, tree)
        assert not problems, "\n".join(problems) + "\n--- hkv up output:\n" + out.text()
    finally:
        if watch is not None:
            watch.close()
        _stop_up(proc, tree)


@dataclass
class Head:
    """A ``ray start --head`` cluster of this test's own (not ours to stop: hkv up joins it)."""

    address: str
    proc: subprocess.Popen[str]
    cluster: dict[int, str]  # its processes before hkv up came


@contextlib.contextmanager
def _ray_head(tmp_path: Path) -> Iterator[Head]:
    """Start the cluster; on the way out stop it and every process it started since."""
    gcs = _free_port()
    temp = tempfile.mkdtemp(prefix="hkvray-", dir="/tmp")  # short: ray's socket paths
    # --temp-dir keeps this cluster's address file out of /tmp/ray: a concurrent ray.init()
    # elsewhere must not join it.
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--port", str(gcs), "--include-dashboard=false",
         "--num-cpus", "2", "--temp-dir", temp,
         "--disable-usage-stats", "--ray-client-server-port", str(_free_port()),
         "--dashboard-agent-listen-port", str(_free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(**NO_AUTH),
        start_new_session=True, cwd=tmp_path)
    head_out = Lines(head, "Ray runtime started")
    cluster: dict[int, str] = {}
    try:
        head_out.wait(90)
        cluster = _descendants(head.pid)
        yield Head(f"127.0.0.1:{gcs}", head, cluster)
    finally:
        everything = cluster | _descendants(head.pid)
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(30)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait(10)
        _kill(_wait_gone(everything, 10) | _group(head.pid))
        shutil.rmtree(temp, ignore_errors=True)


def test_address_up_sigterm_stops_ours_and_leaves_the_cluster(tmp_path: Path) -> None:
    with _ray_head(tmp_path) as h:
        _address_up_sigterm(tmp_path, h)


def _address_up_sigterm(tmp_path: Path, h: Head) -> None:
    proc: subprocess.Popen[str] | None = None
    tree: dict[int, str] = {}
    watch = None
    address, head, cluster = h.address, h.proc, h.cluster
    try:
        # The service actor is reached at the node's IP (ray advertises it even when told
        # --node-ip-address 127.0.0.1), so it binds all addresses, with a token.
        token = tmp_path / "token"
        token.write_text("sigterm-test-token\n")
        proc, out = start_up(tmp_path, "--address", address, "--host", "0.0.0.0",
                             "--auth-token-file", str(token), env=_env(**NO_AUTH))
        endpoint = out.wait(120).split()[-1]
        port = int(endpoint.rsplit(":", 1)[1])
        tree = _descendants(proc.pid)
        workers = {p: a for p, a in _descendants(head.pid).items()
                   if p not in cluster and a.startswith("ray::")}
        assert any("_ServiceHost" in a for a in workers.values()), workers
        assert any("ShardActor" in a for a in workers.values()), workers
        before = _named_actors(address)
        assert "hkv-metadata" in before and any(n.startswith("shard-") for n in before), before
        watch = HealthWatch(endpoint)
        assert watch.first == SERVING
        problems = _check_drained(proc, out, (signal.SIGTERM,), port, watch,
                                  tree | workers)
        after = _named_actors(address)
        if after:
            problems.append(f"named actors left on the cluster: {after}")
        gone = set(cluster) - set(_alive(cluster))
        if gone or head.poll() is not None:
            problems.append(f"the cluster (not ours) lost processes: {gone}, head {head.poll()}")
        assert not problems, "\n".join(problems) + "\n--- hkv up output:\n" + out.text()
    finally:
        if watch is not None:
            watch.close()
        if proc is not None:
            _stop_up(proc, tree)


def _kill_actor(address: str, name: str) -> None:
    """SIGKILL-like end of a named actor of hkv's namespace, from a driver of its own."""
    code = (f"import ray; ray.init(address={address!r}, log_to_driver=False); "
            f"ray.kill(ray.get_actor({name!r}, namespace={NAMESPACE!r}), no_restart=True); "
            "ray.shutdown()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(**NO_AUTH), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_address_up_restarts_a_dead_partition_actor(tmp_path: Path) -> None:
    """--address with --service-replicas 2: a partition's actor that dies is started again on
    its port by hkv up, and the shard rejoins it; SIGTERM still leaves no actor behind."""
    proc: subprocess.Popen[str] | None = None
    tree: dict[int, str] = {}
    with _ray_head(tmp_path) as h:
        try:
            token = tmp_path / "token"
            token.write_text("partition-test-token\n")
            proc, out = start_up(tmp_path, "--address", h.address, "--host", "0.0.0.0",
                                 "--auth-token-file", str(token), "--service-replicas", "2",
                                 "--heartbeat-timeout-s", "2", env=_env(**NO_AUTH))
            endpoint = out.wait(120).split()[-1]
            assert len(endpoint.split(",")) == 2, out.text()
            tree = _descendants(proc.pid)
            assert {"hkv-metadata-0", "hkv-metadata-1"} <= set(_named_actors(h.address))
            _kill_actor(h.address, "hkv-metadata-1")
            _check_partition_back(out, endpoint)
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(EXIT_S) == 0, out.text()
            assert not _named_actors(h.address)
        finally:
            if proc is not None:
                _stop_up(proc, tree)


def _check_partition_back(out: Lines, endpoint: str) -> None:
    """hkv up restarted partition 1's actor on its port and the shard rejoined it; partition
    0 never lost the shard."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any("restarted on" in ln for ln in out.lines):
        time.sleep(0.5)
    assert any("actor of partition 1/2 restarted on" in ln for ln in out.lines), out.text()
    restarted = next(ln for ln in out.lines if "restarted on" in ln).split()[-1]
    assert restarted == endpoint.split(",")[1]  # the same port: clients keep their list
    from workers.local import connect

    meta: Any = connect(endpoint, "partition-test-token")
    try:
        alive, parts = 0, []
        while time.monotonic() < deadline + 30:
            parts = meta.stats()["partitions"]
            alive = parts[1]["gauges"]["owners_alive"]
            if alive == 1:
                break
            time.sleep(0.5)
        assert alive == 1, "the shard did not rejoin the restarted partition"
        assert parts[0]["events"].get("owner_lost", 0) == 0
    finally:
        meta.close()
