"""The README's worker snippet runs as written against a real `hkv up` (issue 17, item 7).

`hkv up` runs as a subprocess with its own local Ray; the snippet is cut out of README.md, its
`attach(...)` line replaced by the one `hkv up` printed when ready, and run twice as a fresh
Python process: the first run reuses nothing and writes the prompt back, the second reuses it.
Then the metadata service process is killed under `hkv up` (item 4): `hkv up` starts it again
on its port, the shards rejoin and re-confirm the blocks they still hold, and the snippet
reuses the whole prompt again (issue 19: a restarted service is back with its hits).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from workers.launcher import clear_stale_ray

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = re.compile(r"<!-- worker-snippet:start -->\s*```python\n(.*?)```", re.S)


def _snippet() -> str:
    m = SNIPPET.search((ROOT / "README.md").read_text())
    assert m, "README.md lost its worker snippet markers"
    return m.group(1)


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _await(up: subprocess.Popen[str], lines: queue.Queue[str], seen: list[str], prefix: str,
           timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            assert up.poll() is None, "".join(seen)
            continue
        seen.append(line)
        if line.startswith(prefix) and (prefix != "hkv up: metadata service (pid"
                                        or "restarted as pid" in line):
            return line.strip()
    raise AssertionError(f"no {prefix!r} line: {''.join(seen)}")


def _run(code: str) -> tuple[int, int, int]:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    m = re.search(r"reused (\d+) written (\d+) failed (\d+)", done.stdout)
    assert m, done.stdout
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def test_readme_worker_snippet_runs_against_hkv_up(tmp_path: Path) -> None:
    clear_stale_ray()
    up = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "up", "--port", "0", "--blocks-per-group",
         "64", "--data-dir", str(tmp_path / "hkv-data")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, seen = _lines(up), []
        worker = _await(up, lines, seen, "hkv up: worker: ").removeprefix("hkv up: worker: ")
        pid = int(re.search(r"metadata service \(pid (\d+)\)", "".join(seen)).group(1))
        attach_line = worker.split("; ", 1)[1]  # `hkv = attach("host:port", ray_address=...)`
        code = re.sub(r"^hkv = attach\(.*$", attach_line, _snippet(), count=1, flags=re.M)
        assert attach_line in code
        reused0, written0, failed0 = _run(code)
        assert reused0 == 0 and written0 > 0 and failed0 == 0
        reused1, _, failed1 = _run(code)
        assert reused1 == 896 and failed1 == 0  # 1,000 tokens: the last resume point is 896

        os.kill(pid, signal.SIGKILL)  # the service crashes under hkv up
        _await(up, lines, seen, "hkv up: metadata service (pid")  # restarted as pid ...
        deadline = time.monotonic() + 60
        while True:  # the shards rejoin within a heartbeat or two, vouching for what they hold
            reused2, _, failed = _run(code)
            if (failed == 0 and reused2 == 896) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        # the restarted service serves the prompt again from the shards' intact memory
        assert failed == 0 and reused2 == 896, "".join(seen)
        assert up.poll() is None  # hkv up kept running
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)
