"""The ``hkv serve`` that ``hkv up`` (or a demo) starts ends with its parent, however the parent
ends: a SIGKILLed ``hkv up`` left its service running, parent pid 1, for good (an orphan seen
running 81 minutes after its demo was killed). ``hkv_service.lifeline``: the parent holds a
pipe's write end, the service stops at EOF. Ray's own processes of a local ``hkv up`` share its
fate through Ray (kernel fate-sharing: PR_SET_PDEATHSIG set by ``ray.init`` on its children,
the raylet's workers end with the raylet); the second test holds that too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from up_proc import Up

from tests.helpers import (
    Lines,
    Procs,
    assert_sigkill_ends_its_tree,
    child_env,
    descendants,
    kill_procs,
    survivors,
)

GONE_WITHIN_S = 20.0  # the service's grace (5 s) and drain, on a loaded 2-core host

# A process that starts the service the way hkv up does (workers.launcher), from a thread
# that ends at once: PR_SET_PDEATHSIG would fire there, with the starting process alive.
_STARTER = """
import threading, time
from hkv_service.settings import SystemSettings
from workers.launcher import _await_listening, _spawn_service, replica_settings
box = []
start = lambda: box.append(_spawn_service(replica_settings(SystemSettings(port=0), 0)))
t = threading.Thread(target=start)
t.start()
t.join()
print("service", box[0].pid, _await_listening(box[0], 120), flush=True)
time.sleep(600)
"""


def test_the_service_ends_with_the_process_that_started_it() -> None:
    starter = subprocess.Popen([sys.executable, "-c", _STARTER], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=child_env(),
                               start_new_session=True)
    tree: Procs = {}
    try:
        out = Lines(starter, "service ")
        pid = int(out.wait(180).split()[1])
        tree = descendants(starter.pid)
        service = {pid: tree[pid]}
        time.sleep(2.0)  # the thread that started it ended long ago: it still runs
        assert survivors(service, 0) == service, "the service ended with its starting thread"
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(10)
        assert survivors(service, GONE_WITHIN_S) == {}, \
            f"hkv serve (pid {pid}) outlived the process that started it by {GONE_WITHIN_S} s"
    finally:
        if starter.poll() is None:
            starter.kill()
        kill_procs(tree)


def test_a_sigkilled_hkv_up_leaves_no_process_behind(tmp_path: Path) -> None:
    up = Up(tmp_path, tmp_path / "data")
    tree: Procs = {}
    try:
        service_pid = up.service_pid()
        up.ready()
        tree = descendants(up.proc.pid)
        assert service_pid in tree, tree
        assert_sigkill_ends_its_tree(up.proc, service_pid, tree, "hkv up", GONE_WITHIN_S)
    finally:
        kill_procs(tree)
        up.stop(10)


pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")
