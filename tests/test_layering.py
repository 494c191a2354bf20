"""Production code outside the core reaches a ``CacheState`` through its methods only: never its
record tables or private helpers (``state.objects``, ``state.owners``, ``state._handle``). The
import rules themselves are import-linter contracts (pyproject.toml, run by .ci/run); this is
the one rule they cannot state."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERNALS = {"objects", "owners", "leases", "log"}
STATE_NAMES = {"state", "st", "cache_state"}


def _production_files() -> list[Path]:
    out = []
    for pkg in ("hkv_service", "workers", "storage"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(("hkv_service/core/", "hkv_service/proto_gen/")):
                continue
            out.append(path)
    return out


def _reaches_in(node: ast.Attribute) -> bool:
    target = node.value
    name = target.id if isinstance(target, ast.Name) else (
        target.attr if isinstance(target, ast.Attribute) else None)
    if name not in STATE_NAMES:
        return False
    return node.attr in INTERNALS or (node.attr.startswith("_") and not node.attr.startswith("__"))


def test_no_production_code_reaches_into_cache_state_internals() -> None:
    hits = []
    for path in _production_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and _reaches_in(node):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert hits == []


def test_the_check_sees_a_reach_in() -> None:
    tree = ast.parse("n = len(state.objects)\nh = self.state._handle(r)\n")
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _reaches_in(n)]
    assert {n.attr for n in found} == {"objects", "_handle"}
