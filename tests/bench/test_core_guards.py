"""``hkv bench core --quick`` is what CI runs (.ci/run): a metadata budget or a lookup ratio
guard broken fails the command with a sentence naming it; held, it exits 0. The guards are
checked on the bench's own result, so these cases build results around them (a real quick
run's figures are checked by CI itself)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from hkv_service import bench
from hkv_service.bench import core


def _result(per_object: float, walk: float, handles: float) -> dict[str, Any]:
    return {
        "name": "core", "quick": True,
        "figures": {"metadata_bytes_per_object": per_object},
        "baseline": {},
        "ratios": {"lookup_vs_dict_walk": walk, "lookup_with_handles_vs_dict_walk": handles},
    }


def test_held_guards_say_nothing() -> None:
    assert core.failed_guards(_result(core.BYTES_PER_OBJECT_BUDGET, 1.2, 2.4)) == []


@pytest.mark.parametrize(("figures", "named"), [
    ((core.BYTES_PER_OBJECT_BUDGET + 0.5, 1.2, 2.4), "bytes per object, over the budget"),
    ((200.0, core.RATIO_GUARDS["lookup_vs_dict_walk"] + 0.1, 2.4), "lookup_vs_dict_walk is"),
    ((200.0, 1.2, core.RATIO_GUARDS["lookup_with_handles_vs_dict_walk"] + 0.1),
     "lookup_with_handles_vs_dict_walk is"),
])
def test_a_broken_guard_fails_the_command_with_a_sentence(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        figures: tuple[float, float, float], named: str) -> None:
    result = _result(*figures)
    result["failed_guards"] = core.failed_guards(result)
    monkeypatch.setattr(core, "run", lambda quick: result)
    rc = bench.run_bench(argparse.Namespace(name="core", quick=True, json=True))
    err = capsys.readouterr().err
    assert rc == 1 and named in err and err.startswith("hkv bench core: ")


def test_held_guards_exit_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _result(200.0, 1.2, 2.4)
    result["failed_guards"] = core.failed_guards(result)
    monkeypatch.setattr(core, "run", lambda quick: result)
    assert bench.run_bench(argparse.Namespace(name="core", quick=True, json=True)) == 0


def test_the_metadata_budget_holds_on_the_fresh_process_figure() -> None:
    """The figure CI's budget guard reads: bytes per tracked object, measured in a fresh
    interpreter (tracemalloc slopes at 2,048 blocks: deterministic, not a timing), under the
    budget. A record or entry field added per object fails here, not in production."""
    per_object, per_token = core._fresh_slopes(every_tail=False)
    assert 0 < per_object <= core.BYTES_PER_OBJECT_BUDGET, per_object
    assert per_token > 0
