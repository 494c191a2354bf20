"""Which wiring the demo runs on: one asked for by name never silently becomes the other."""

from __future__ import annotations

from typing import Any

import pytest

from hkv_service.demo import run, wiring
from hkv_service.refmodel import RefModel
from hkv_service.specs import default_spec


class _NoRay(RuntimeError):
    pass


@pytest.fixture
def failing_system(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise _NoRay("ray did not start within 60 s")

    monkeypatch.setattr(wiring.SystemWiring, "__init__", refuse)


def test_a_system_asked_for_by_name_that_cannot_start_is_an_error(
        failing_system: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # regression: under load the system wiring failed to start and the run went on
    # in-process with no word (note=None): a test asking for the system passed on the other
    with pytest.raises(_NoRay):
        run.make_backend(RefModel(default_spec()), {}, note=None, backend="system")


def test_the_default_system_falls_back_in_process_and_says_so(
        failing_system: None, monkeypatch: pytest.MonkeyPatch) -> None:
    notes: list[str] = []
    be = run.make_backend(RefModel(default_spec()), {}, note=notes.append, backend=None)
    try:
        assert be.name == "inprocess"
        assert any("could not start" in n and "_NoRay" in n for n in notes), notes
    finally:
        be.close()
