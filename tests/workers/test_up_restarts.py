"""``hkv up`` over a long life (issue 35 item 6, RELIABILITY.md row 28): its metadata service
restarts are budgeted per time window (``--service-restarts`` within ``--restart-window-s``),
so deaths spread over time are each restarted, however many there are, while a crash loop
(deaths faster than the window allows) still stops ``hkv up`` with exit 1 and a sentence.

Real processes: ``hkv up`` as a subprocess with its own Ray, its ``hkv serve`` child SIGKILLed
by the pid hkv up printed, a lookup over gRPC after each restart.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from up_proc import Up

from hkv_service.client import MetadataClient
from hkv_service.core.funnel import LookupRequest

DEATHS = 10  # twice what the old fixed budget (5 restarts in hkv up's life) allowed
WINDOW_S = 0.2  # with --service-restarts 1: at most one restart per 0.2 s


def test_deaths_spread_over_time_are_each_restarted(tmp_path: Path, w: Any) -> None:
    w.clear_stale_ray()
    up = Up(tmp_path, tmp_path / "data", "--service-restarts", "1",
            "--restart-window-s", str(WINDOW_S))
    try:
        endpoint, _ray = up.ready()
        pid = up.service_pid()
        hashes = w.prompt(2, seed=1)
        for _death in range(DEATHS):
            pid = up.kill_service(pid)
            with MetadataClient(endpoint) as client:  # serving again, on the same port
                assert client.lookup(LookupRequest(hashes)).usable_tokens == 0
            # Spread: the next death comes only once this restart left the window (paced by
            # the test, not measured: the budget reads hkv up's own clock).
            time.sleep(WINDOW_S)
        assert up.proc.poll() is None, up.text()
    finally:
        up.stop()


def test_a_crash_loop_stops_hkv_up_with_exit_1_and_a_sentence(tmp_path: Path, w: Any) -> None:
    w.clear_stale_ray()
    up = Up(tmp_path, tmp_path / "data", "--service-restarts", "2")  # in the default window
    try:
        up.ready()
        pid = up.service_pid()
        for _restart in range(2):  # each death at once after the restart before it
            pid = up.kill_service(pid)
        mark = len(up.lines)
        os.kill(pid, signal.SIGKILL)  # a third death within the window: a crash loop
        assert up.proc.wait(120) == 1, up.text()
        m = up.wait_for(r"hkv up: error: .*", 10, start=mark)
        assert ("metadata service exited" in m.group(0) and "crash loop" in m.group(0)
                and "--service-restarts 2" in m.group(0)), m.group(0)
        up.wait_for(r"^hkv up: stopped$", 10, start=mark)  # and it stopped what it started
    finally:
        up.stop()
