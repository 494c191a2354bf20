"""``hkv up`` as a subprocess for tests: its own session, its output read on a thread, lines
awaited by pattern, stopped with SIGTERM (SIGKILL to its process group past a bound).

It inherits the environment (``RAY_TMPDIR`` too: its Ray lives where the caller's does).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["ROOT", "Up", "env"]

ROOT = Path(__file__).resolve().parents[2]
_SERVICE_PID = re.compile(r"metadata service (?:partition \S+ )?\(pid (\d+)\) listening")
_RESTARTED = re.compile(r"\(pid (?P<old>\d+)\) restarted as pid (?P<new>\d+)")


def env() -> dict[str, str]:
    out = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    out.pop("RAY_ADDRESS", None)
    return out


class Up:
    """``hkv up --port 0 --data-dir DATA`` plus ``flags``, started at once."""

    def __init__(self, cwd: Path, data_dir: Path, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hkv_service.cli", "up", "--port", "0", "--data-dir",
             str(data_dir), "--blocks-per-group", "16", "--disk-budget-bytes", str(32 << 20),
             *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
            start_new_session=True, cwd=cwd)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._done = False
        threading.Thread(target=self._pump, name="hkv-up-output", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip())
                self._changed.notify_all()
        with self._changed:
            self._done = True
            self._changed.notify_all()

    def wait_for(self, pattern: str | re.Pattern[str], timeout_s: float = 180.0,
                 start: int = 0) -> re.Match[str]:
        """The first line from index ``start`` on that ``pattern`` finds; AssertionError with
        the output when hkv up ends or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for line in self.lines[start:]:
                    if m := re.search(pattern, line):
                        return m
                start = len(self.lines)
                left = deadline - time.monotonic()
                if self._done or left <= 0:
                    raise AssertionError(f"no line matching {pattern!r}:\n{self.text()}")
                self._changed.wait(min(left, 1.0))

    def ready(self) -> tuple[str, str]:
        """(endpoint, Ray address) from the ``attach(...)`` line hkv up prints when ready."""
        m = self.wait_for(r"hkv up: worker: .*attach\('([^']+)', ray_address='([^']+)'\)")
        return m.group(1), m.group(2)

    def service_pid(self) -> int:
        """The pid of the (first) metadata service hkv up started."""
        return int(self.wait_for(_SERVICE_PID).group(1))

    def kill_service(self, pid: int, timeout_s: float = 120.0) -> int:
        """SIGKILL the service ``pid``; wait for hkv up to say it restarted it; the new pid."""
        mark = len(self.lines)
        os.kill(pid, signal.SIGKILL)
        m = self.wait_for(_RESTARTED, timeout_s, start=mark)
        assert int(m["old"]) == pid, m.group(0)
        return int(m["new"])

    def text(self) -> str:
        return "\n".join(self.lines[-60:])

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (hkv up drains and stops all it started); its process group SIGKILLed past
        ``timeout_s``. Its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        return self.proc.returncode
