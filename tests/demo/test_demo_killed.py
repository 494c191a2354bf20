"""A system-wiring demo killed from outside (SIGKILL: a helper's ``timeout``, the OOM killer)
leaves nothing running: its ``hkv serve`` (seen running 81 minutes later, parent pid 1) ends
through ``hkv_service.lifeline``, and the local Ray it started ends with it (Ray's own
fate-sharing, and the watcher ``workers.launcher`` starts for its agents)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import (
    Lines,
    Procs,
    assert_sigkill_ends_its_tree,
    descendants,
    kill_procs,
    up_env,
)

GONE_WITHIN_S = 20.0


def test_a_sigkilled_system_demo_leaves_no_process_behind(tmp_path: Path) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "demo", "--backend", "system",
         "--requests", "500", "--workers", "1"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=up_env(), start_new_session=True)
    tree: Procs = {}
    try:
        out = Lines(demo, "shard(s) up")
        out.wait(240)
        m = re.search(r"metadata service \(pid (\d+)\) listening", out.text())
        assert m, out.text()
        service_pid = int(m.group(1))
        tree = descendants(demo.pid)
        assert service_pid in tree, (service_pid, tree)
        assert demo.poll() is None, "the demo ended before it could be killed"
        assert_sigkill_ends_its_tree(demo, service_pid, tree, "demo", GONE_WITHIN_S)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
        kill_procs(tree)
