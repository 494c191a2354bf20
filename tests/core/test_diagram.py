from __future__ import annotations

from pathlib import Path

from hkv_service.core.diagram import splice


def test_architecture_doc_has_the_generated_diagrams() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    assert splice(doc) == doc, (
        "run `python -m hkv_service.core.diagram --write docs/architecture.md`"
    )
