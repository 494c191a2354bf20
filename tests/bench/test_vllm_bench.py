"""``hkv bench vllm`` where vLLM is absent, and the bench's own bookkeeping (no vLLM needed).

The bench itself needs vLLM and runs in ``.ci/vllm`` (``--quick``, in ``.venv-vllm``)."""

from __future__ import annotations

import importlib.util
import time
import types
from typing import Any

import pytest

from hkv_service.bench import vllm as bench
from hkv_service.cli import BENCH_NAMES, main


def _no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "vllm" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_without_vllm_the_bench_exits_2_saying_what_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert "vllm" in BENCH_NAMES
    _no_vllm(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vllm", "--json"])
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1 and "vLLM is not installed" in out.err
    assert "bash .ci/vllm" in out.err and "pip install vllm" in out.err


def test_hooks_time_each_wrapped_call_and_take_empties_them() -> None:
    class Conn:
        def slow(self, x: int) -> int:
            time.sleep(0.01)
            return x + 1

        def fails(self) -> None:
            raise ValueError("boom")

    conn, hooks = Conn(), bench._Hooks()
    hooks.wrap(conn, ("slow", "fails"))

    def ran_the_model() -> tuple[None, bool]:
        assert conn.slow(1) == 2 and conn.slow(2) == 3
        with pytest.raises(ValueError):
            conn.fails()  # timed too, and still raised
        return None, True

    def ran_nothing() -> tuple[None, bool]:
        conn.slow(3)
        return None, False

    core = types.SimpleNamespace(step_fn=ran_the_model)
    hooks.steps(core)  # each step's hook seconds go where the step says it ran
    core.step_fn()
    core.step_fn = ran_nothing
    hooks.steps(core)
    core.step_fn()
    got = hooks.take()
    assert got["slow"] >= 0.02 and "fails" in got
    assert got["idle.slow"] >= 0.01 and "idle.fails" not in got
    assert hooks.take() == {}


def test_per_request_figures_average_over_requests_and_add_up() -> None:
    rows = [{"a": 0.001, "b": 0.002}, {"a": 0.003}]
    got = bench._per_request_us(rows, ("a", "b"))
    assert got == {"a": 2000.0, "b": 1000.0, "total": 3000.0}


@pytest.mark.parametrize("quick", [True, False])
def test_the_bench_model_alternates_sliding_and_full_layers(quick: bool) -> None:
    cfg = bench._model_config(quick)
    types = cfg["layer_types"]
    assert len(types) == cfg["num_hidden_layers"]
    assert types[::2] == ["sliding_attention"] * (len(types) // 2)
    assert types[1::2] == ["full_attention"] * (len(types) // 2)


def test_an_unknown_model_exits_2_with_a_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vllm", "--model", "mamba9", "--json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'mamba9' is not one of" in err and "qwen3-next" in err


def test_model_is_for_the_vllm_bench_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "core", "--model", "qwen3-next"]) == 2
    assert "--model is for hkv bench vllm only" in capsys.readouterr().err
