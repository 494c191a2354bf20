"""The system wiring's shard kill waits for a shard Ray is still restarting (a demo run on the
system wiring, seed 6, ended with a traceback and no report: the kill's ping met
``ActorUnavailableError`` while the shard came back from the kill before)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from hkv_service.demo import wiring
from hkv_service.demo.wiring import SystemWiring


class Restarting(Exception):
    """What Ray raises for an actor that is restarting."""


def test_a_kill_waits_for_the_shard_to_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    w: Any = object.__new__(SystemWiring)  # no Ray: only the kill's own steps run
    w._killed = {}
    answers: list[Any] = [Restarting("restarting"), Restarting("restarting"), {"pid": 4242}]

    def ping(sid: str, timeout_s: float = 10.0) -> dict[str, Any]:
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return dict(got)

    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(w, "_ping", ping)
    monkeypatch.setattr(wiring.time, "sleep", lambda s: None)
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    w.crash_shard("shard-0")
    assert killed == [(4242, signal.SIGKILL)] and w._killed == {"shard-0": 4242}


def test_a_shard_that_never_answers_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    w: Any = object.__new__(SystemWiring)
    w._killed = {}
    monkeypatch.setattr(w, "_ping", lambda sid, timeout_s=10.0: (_ for _ in ()).throw(
        Restarting("restarting")))
    monkeypatch.setattr(w, "_actor_state", lambda sid: "state=RESTARTING")
    monkeypatch.setattr(wiring, "REVIVE_WAIT_S", 0.0)
    monkeypatch.setattr(wiring.time, "sleep", lambda s: None)
    with pytest.raises(TimeoutError, match=r"did not answer.*RESTARTING"):
        w.crash_shard("shard-0")
