from __future__ import annotations

from pathlib import Path

from hkv_service.core.diagram import render_all


def test_architecture_doc_has_the_generated_diagrams() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    assert render_all() in doc, "run `python -m hkv_service.core.diagram` and paste into docs"
