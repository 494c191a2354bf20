"""State diagrams generated from the transition table, so docs cannot drift from the code.

``python -m hkv_service.core.diagram`` prints one Mermaid ``stateDiagram-v2`` per kind;
``--write docs/architecture.md`` splices them between the doc's markers, and a test checks the
doc is current. (This module only builds strings; the file I/O is in the ``__main__`` edge.)
"""

from __future__ import annotations

from .states import Kind
from .transitions import PRECONDITIONS, TABLE

__all__ = ["mermaid", "render_all", "splice"]


def mermaid(kind: Kind) -> str:
    lines = ["```mermaid", "stateDiagram-v2"]
    for (src, event), dst in sorted(TABLE[kind].items(), key=lambda kv: (kv[0][0], kv[0][1])):
        guard = " [guarded]" if (kind, event) in PRECONDITIONS else ""
        lines.append(f"    {src.value} --> {dst.value}: {event.value}{guard}")
    lines.append("```")
    return "\n".join(lines)


def render_all() -> str:
    return "\n\n".join(f"### {kind.value}\n\n{mermaid(kind)}" for kind in TABLE)


def splice(doc: str) -> str:
    """``doc`` with the text between the diagram markers replaced by :func:`render_all`."""
    start = doc.index("<!-- diagrams:start")
    start = doc.index("\n", start) + 1
    end = doc.index("<!-- diagrams:end -->")
    return doc[:start] + render_all() + "\n" + doc[end:]


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:2] == ["--write"]:
        target = Path(sys.argv[2])
        target.write_text(splice(target.read_text()))
    else:
        print(render_all())
