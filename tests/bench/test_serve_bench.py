"""``hkv bench serve`` where vLLM is absent, and its sizing and figures (no vLLM needed).

The bench itself needs vLLM and runs in ``.ci/vllm`` (``--quick``) and in
``tests/connectors/test_bench_serve.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from hkv_service.bench import serve
from hkv_service.cli import BENCH_NAMES, main


def _exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``hkv ARGV`` ends with status 2 (raised by the bench, or returned to ``sys.exit``)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1, out.err  # one sentence
    return out.err


def test_without_vllm_anywhere_the_bench_exits_2_saying_where_to_get_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert "serve" in BENCH_NAMES
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "vllm" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(serve, "REPO", tmp_path)  # no .venv-vllm beside this "repository"
    monkeypatch.delenv(serve.ENV_PYTHON, raising=False)
    err = _exit_2(["bench", "serve", "--quick", "--json"], capsys)
    assert "vLLM is not installed" in err and "--vllm-python" in err
    assert str(tmp_path / ".venv-vllm" / "bin" / "python") in err


def test_a_given_python_without_vllm_exits_2_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-such-python")
    err = _exit_2(["bench", "serve", "--quick", "--vllm-python", missing], capsys)
    assert f"{missing} cannot import vllm" in err


def test_the_env_names_the_python_when_no_flag_does(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = str(tmp_path / "env-python")
    monkeypatch.setenv(serve.ENV_PYTHON, missing)
    with pytest.raises(serve.NoVllm, match="env-python cannot import vllm"):
        serve.find_vllm_python(None)


@pytest.mark.parametrize("flag", [["--vllm-python", "/x/python"], ["--rounds", "2"],
                                  ["--save-min-sightings", "2"], ["--doc-tokens", "2048"]])
def test_serve_flags_are_refused_by_the_other_benches(
        flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_2(["bench", "core", *flag], capsys)
    assert f"{flag[0]} applies to 'hkv bench serve' only" in err


@pytest.mark.parametrize(("flag", "value"), [("--rounds", "0"), ("--rounds", "21"),
                                             ("--save-min-sightings", "0"),
                                             ("--doc-tokens", "63"), ("--doc-tokens", "3585")])
def test_a_serve_number_out_of_range_exits_2_before_any_engine_starts(
        flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_2(["bench", "serve", "--quick", flag, value], capsys)
    assert f"{flag} must be" in err


def _phase(ttft: list[float], wall_s: float, prompt: float, hits: float,
           connector: dict[str, float] | None = None) -> serve.Phase:
    zero = dict.fromkeys(serve.METRICS, 0.0)
    after = dict(zero, **{"vllm:prompt_tokens_total": prompt,
                          "vllm:external_prefix_cache_hits_total": hits})
    results = [serve.Result(f"q{i}", 10, ttft_s=t, e2e_s=t, output=[1]) for i, t in
               enumerate(ttft)]
    return serve.Phase(results, wall_s, [zero], [after], {"engines": 1.0}, connector or {},
                       [0.0, 0.0, 0.0], 0.5)


def test_pooled_phases_put_every_request_in_the_percentiles_and_sum_the_rest() -> None:
    got = serve.pool([_phase([0.1, 0.2], 1.0, 1000, 500, {"saved": 3.0}),
                      _phase([0.3, 0.4, 0.5, 0.6], 3.0, 3000, 500, {"saved": 1.0})])
    assert got["requests"] == 6 and got["requests_per_s"] == 1.5  # 6 requests in 4 s
    assert got["ttft_p50_s"] == pytest.approx(0.35)  # over all six, not a mean of medians
    assert got["prompt_tokens"] == 4000 and got["hkv_share"] == 0.25
    assert got["connector"] == {"saved": 4.0} and got["cpu_s"] == {"engines": 2.0}
    assert got["quiet_after_s"] == [0.5, 0.5] and len(got["load_avg_1_5_15"]) == 2


def test_rounds_alternate_which_configuration_goes_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[int, str, str]] = []

    def run_phase(cfg: serve.Config, wl: str, w: serve.Workload, seed: int) -> serve.Phase:
        ran.append((seed, wl, cfg.name))
        return _phase([0.1], 1.0, 10, 0)

    monkeypatch.setattr(serve, "_run_phase", run_phase)
    configs = (serve.Config("alone", []), serve.Config("hkv", []))
    lines: list[str] = []
    phases = serve._run_rounds(configs, serve.Workload.of(True), 2, lines.append)
    assert ran == [(0, "shared_prefix", "alone"), (0, "shared_prefix", "hkv"),
                   (0, "no_reuse", "hkv"), (0, "no_reuse", "alone"),
                   (1, "shared_prefix", "hkv"), (1, "shared_prefix", "alone"),
                   (1, "no_reuse", "alone"), (1, "no_reuse", "hkv")]
    assert [len(phases[c][wl]) for c in ("alone", "hkv") for wl in serve.WORKLOADS] == [2] * 4
    assert len(lines) == 8 and lines[0].startswith("round 1/2 shared_prefix alone")


def test_the_report_pools_rounds_and_gives_each_rounds_ratios() -> None:
    w = serve.Workload.of(True)
    phases = {"alone": {"shared_prefix": [_phase([1.0], 1.0, 100, 0), _phase([1.0], 1.0, 100, 0)],
                        "no_reuse": [_phase([1.0], 1.0, 100, 0), _phase([1.0], 1.0, 100, 0)]},
              "hkv": {"shared_prefix": [_phase([0.2], 1.0, 100, 50), _phase([0.6], 1.0, 100, 50)],
                      "no_reuse": [_phase([1.0], 1.0, 100, 0), _phase([1.0], 2.0, 100, 0)]}}
    got = serve._report(True, w, phases, 2, 2, {"alone": [1], "hkv": [1]},
                        {"alone": ["[0]"], "hkv": ["[0]"]}, 8, 0.0)
    by_round = got["figures"]["ratios_by_round"]
    assert [r["shared_prefix_ttft_p50"] for r in by_round] == [0.2, 0.6]
    assert [r["no_reuse_requests_per_s"] for r in by_round] == [1.0, 0.5]
    assert got["ratios"]["no_reuse_requests_per_s"] == pytest.approx(2 / 3, abs=1e-4)
    assert got["ratios"]["shared_prefix_ttft_p50"] == pytest.approx(0.4)
    assert got["figures"]["outputs_compared"] == 4  # keyed by round: none overwrites another
    targets = got["figures"]["targets"]
    assert targets["shared_prefix_ttft_p50 <= 0.5"] and not targets[
        "no_reuse_requests_per_s >= 0.97"]


@pytest.mark.parametrize(("quick", "doc_tokens"), [(True, None), (False, None), (False, 3584)])
def test_the_working_set_is_about_four_engines_and_every_prompt_fits(
        quick: bool, doc_tokens: int | None) -> None:
    w = serve.Workload.of(quick, doc_tokens)
    assert w.doc_tokens == doc_tokens or doc_tokens is None
    assert w.longest_prompt + 64 <= serve.TINY["max_position_embeddings"]  # the engine's max
    engine_tokens = w.engine_blocks() * serve.BLOCK // 2  # two KV cache groups
    assert 3.5 <= w.working_set_tokens / engine_tokens <= 4.5
    assert engine_tokens >= 2 * w.longest_prompt


def test_summary_takes_percentiles_and_the_shares_from_metric_deltas() -> None:
    results = [serve.Result(f"r{i}", 100, ttft_s=0.01 * (i + 1), e2e_s=0.1, output=[5, 6])
               for i in range(100)]
    zero = dict.fromkeys(serve.METRICS, 0.0)
    a = dict(zero, **{"vllm:prompt_tokens_total": 6000.0,
                      "vllm:external_prefix_cache_hits_total": 3000.0,
                      "vllm:prefix_cache_hits_total": 600.0})
    b = dict(zero, **{"vllm:prompt_tokens_total": 4000.0,
                      "vllm:external_prefix_cache_hits_total": 1000.0})
    got = serve.summarize(results, 2.0, [zero, zero], [a, b])
    assert got["requests"] == 100 and got["requests_per_s"] == 50.0
    assert got["output_tokens_per_s"] == 100.0
    assert got["ttft_p50_s"] == pytest.approx(0.505) and got["ttft_p99_s"] == 0.99
    assert got["prompt_tokens"] == 10000 and got["hkv_hit_tokens"] == 4000
    assert got["hkv_share"] == 0.4 and got["local_prefix_share"] == 0.06
    assert got["min_top2_margin"] is None  # these results carry no logprobs


def test_connector_counters_add_up_over_the_log_lines_after_the_mark(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    early = "INFO KV Transfer metrics: load_ok=7, lookup_s=9.0\n"
    log.write_text(early + "INFO KV Transfer metrics: load_ok=2, lookup_s=0.5, "
                   "downgrade.NO_STATE=3\nother line\nKV Transfer metrics: load_ok=1, "
                   "lookup_s=0.25\n")
    engine = serve.Engine("e", 0, None, log)  # type: ignore[arg-type]
    got = engine.connector_stats(len(early))
    assert got == {"load_ok": 3.0, "lookup_s": 0.75, "downgrade.NO_STATE": 3.0}


def test_both_configurations_run_vllm_with_one_cpu_binding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM on CPU reserves one more core when a kv_transfer_config is set (on 2 cores: none,
    and the model on 2 threads): the bench fixes the reservation for every engine, so the two
    arms differ only by hkv; a value the user set is kept, for both."""
    monkeypatch.delenv(serve.RESERVED_CPUS_ENV, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a test module's, in process
    alone, with_hkv = serve._child_env(), serve._child_env(RAY_ADDRESS="127.0.0.1:1")
    assert alone[serve.RESERVED_CPUS_ENV] == with_hkv[serve.RESERVED_CPUS_ENV] == "1"
    # the engines run as `vllm serve` does (an engine process, its model bound to a core)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in alone | with_hkv
    monkeypatch.setenv(serve.RESERVED_CPUS_ENV, "0")
    assert serve._child_env()[serve.RESERVED_CPUS_ENV] == "0"
    assert serve._child_env(RAY_ADDRESS="127.0.0.1:1")[serve.RESERVED_CPUS_ENV] == "0"


def test_replica_i_runs_its_model_on_core_i_unless_the_caller_binds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cores = sorted(serve.os.sched_getaffinity(0))
    env = {"X": "1"}
    got = [serve._replica_env(env, i)[serve.BIND_ENV] for i in range(len(cores) + 1)]
    assert got == [str(c) for c in cores] + [str(cores[0])]  # round-robin over the cores
    assert env == {"X": "1"}  # a copy: the configurations' shared env is left alone
    mine = {serve.BIND_ENV: "0-1"}
    assert serve._replica_env(mine, 1) is mine  # the caller's binding wins


def test_an_engines_cpu_binding_comes_from_its_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, "
                   "core ids=[0, 1]\nother\n")
    assert serve.Engine("e", 0, None, log).cpu_binding() == "[0, 1]"  # type: ignore[arg-type]
    log.write_text("no binding line\n")
    assert serve.Engine("e", 0, None, log).cpu_binding() is None  # type: ignore[arg-type]


def _result(key: str, prompt: list[int], output: list[int], margins: list[float]
            ) -> serve.Result:
    digest = serve.hashlib.blake2b(serve.json.dumps(prompt).encode(), digest_size=8).hexdigest()
    return serve.Result(key, len(prompt), 0.1, 0.2, output, margins, digest)


def test_an_output_that_differs_is_explained_only_by_a_near_tie_or_an_earlier_turn() -> None:
    alone = {"same": _result("same", [1, 2], [5, 6], [1.0, 1.0]),
             "tie": _result("tie", [1, 2], [5, 6, 7], [1.0, 0.0, 1.0]),
             "wrong": _result("wrong", [1, 2], [5, 6], [0.5, 0.5]),
             "later": _result("later", [1, 2, 5, 6], [9], [0.5])}
    hkv = {"same": _result("same", [1, 2], [5, 6], [1.0, 1.0]),
           "tie": _result("tie", [1, 2], [5, 8, 7], [1.0, 1 / 64, 1.0]),
           "wrong": _result("wrong", [1, 2], [4, 6], [0.5, 0.5]),
           "later": _result("later", [1, 2, 5, 7], [8], [0.5])}
    got = serve.compare_outputs(alone, hkv)
    assert set(got) == {"tie", "wrong", "later"}
    assert got["tie"] == {"first_token": 1, "margin_alone": 0.0, "margin_hkv": 0.015625,
                          "cause": serve.NEAR_TIE_CAUSE}
    assert got["wrong"]["cause"] == serve.NOT_NEAR_TIE and got["wrong"]["first_token"] == 0
    assert got["later"] == {"cause": serve.EARLIER_TURN}


def test_margins_are_top1_minus_top2_per_streamed_token() -> None:
    lp = {"top_logprobs": [{"t5": -0.1, "t6": -2.6}, {"t7": -1.0}, None]}
    assert serve._margins(lp) == [pytest.approx(2.5), serve.math.inf, serve.math.inf]
    assert serve._margins(None) == []


def test_cpu_split_charges_each_role_its_sessions_and_the_rest_to_the_machine() -> None:
    before = ({10: 1.0, 20: 5.0, 30: 2.0}, 100.0)
    after = ({10: 4.0, 20: 6.5, 30: 2.5, 40: 9.0}, 120.0)
    got = serve.cpu_split({"engines": [10, 30], "hkv_up": [20]}, before, after)
    assert got == {"engines": 3.5, "hkv_up": 1.5, "rest_of_machine": 15.0}


def test_this_process_cpu_is_counted_in_its_session() -> None:
    sid = serve.os.getsid(0)
    a = serve._cpu_by_session()[sid]
    deadline = serve.time.process_time() + 0.2
    while serve.time.process_time() < deadline:  # bounded: 0.2 s of CPU
        pass
    assert serve._cpu_by_session()[sid] - a >= 0.15
    assert serve._machine_cpu_s() > 0


def test_a_relative_vllm_python_is_made_absolute(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """The engines start in the run's own folder: a relative ``--vllm-python`` (as
    ``.venv-vllm/bin/python`` from the checkout) would name nothing there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(serve, "_has_vllm", lambda python: True)
    assert serve.find_vllm_python(".venv-vllm/bin/python") == str(
        tmp_path / ".venv-vllm" / "bin" / "python")
    assert serve.find_vllm_python("python3") == "python3"  # a name: looked up on PATH
