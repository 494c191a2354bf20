"""workers/attach.py's Ray join (``join_ray``, what ``attach`` and the vLLM connector call):
a process joining hkv's Ray must not be ended by Ray when the cluster's GCS goes away.

Ray's core worker exits a process (``std::_Exit``, no Python exception) whose GCS stays
unreachable for ``gcs_rpc_server_reconnect_timeout_s`` (default 60 s), read from
``RAY_gcs_rpc_server_reconnect_timeout_s`` when ``ray.init`` builds the core worker. The join
sets it for that call only, and never over a value the user set. ``ray.init`` is recorded
here (what it saw of the environment); the real thing is in test_up_worker_survives.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import workers.attach as attach_mod
from workers.attach import GCS_LOSS_TOLERANCE_S, GCS_RECONNECT_ENV, join_ray


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, dict[str, Any]]]:
    """What each ``ray.init`` was called with: the reconnect variable then, and its kwargs."""
    calls: list[tuple[str | None, dict[str, Any]]] = []

    def init(**kwargs: Any) -> None:
        calls.append((os.environ.get(GCS_RECONNECT_ENV), kwargs))

    monkeypatch.setattr(attach_mod.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(attach_mod.ray, "init", init)
    monkeypatch.setattr(attach_mod, "_token_auth_if_available", lambda: None)
    monkeypatch.delenv(GCS_RECONNECT_ENV, raising=False)
    return calls


def test_joining_outlives_the_gcs_for_that_call_only(seen: list[Any]) -> None:
    join_ray("10.0.0.1:6379", "hkv")
    assert seen == [(str(GCS_LOSS_TOLERANCE_S),
                     {"address": "10.0.0.1:6379", "namespace": "hkv", "log_to_driver": False})]
    assert GCS_RECONNECT_ENV not in os.environ  # processes started later do not inherit it


def test_a_value_the_user_set_is_kept(seen: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GCS_RECONNECT_ENV, "120")
    join_ray("auto")
    assert [env for env, _kw in seen] == ["120"] and os.environ[GCS_RECONNECT_ENV] == "120"


@pytest.mark.parametrize("address", [None, "local"])
def test_a_cluster_started_here_keeps_rays_default(seen: list[Any], address: str | None
                                                   ) -> None:
    # ray.init starts a GCS and raylet then, which would inherit the variable
    join_ray(address)
    assert [env for env, _kw in seen] == [None]


def test_the_tolerance_fits_rays_32_bit_milliseconds() -> None:
    assert GCS_LOSS_TOLERANCE_S * 1000 < 2**32  # the raylet multiplies it in uint32
    assert GCS_LOSS_TOLERANCE_S >= 7 * 24 * 3600  # a week without hkv's Ray at least


def test_a_process_already_in_ray_is_left_as_it_is(seen: list[Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attach_mod.ray, "is_initialized", lambda: True)
    join_ray("auto")
    assert seen == []
