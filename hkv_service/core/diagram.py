"""State diagrams generated from the transition table, so docs cannot drift from the code.

``python -m hkv_service.core.diagram`` prints one Mermaid ``stateDiagram-v2`` per kind;
``docs/architecture.md`` embeds the output and a test checks it is current.
"""

from __future__ import annotations

from .states import Kind
from .transitions import PRECONDITIONS, TABLE

__all__ = ["mermaid", "render_all"]


def mermaid(kind: Kind) -> str:
    lines = ["```mermaid", "stateDiagram-v2"]
    for (src, event), dst in sorted(TABLE[kind].items(), key=lambda kv: (kv[0][0], kv[0][1])):
        guard = " [guarded]" if (kind, event) in PRECONDITIONS else ""
        lines.append(f"    {src.value} --> {dst.value}: {event.value}{guard}")
    lines.append("```")
    return "\n".join(lines)


def render_all() -> str:
    return "\n\n".join(f"### {kind.value}\n\n{mermaid(kind)}" for kind in TABLE)


if __name__ == "__main__":
    print(render_all())
