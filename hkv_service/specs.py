"""Where cache specs come from: a file the user names, or one of the reference model's packaged
specs (attention only, the default elsewhere; and with a recurrent layer, the demo's)."""

from __future__ import annotations

from importlib import resources

from .core.spec import CacheSpec, load_spec

__all__ = ["RECURRENT_SPEC", "REFERENCE_SPEC", "default_spec", "demo_spec", "packaged_spec",
           "resolve_spec"]

REFERENCE_SPEC = "reference_spec.yaml"
# the reference layout plus a gated linear recurrence (a RECURRENT group: Kind.STATE objects)
RECURRENT_SPEC = "reference_recurrent_spec.yaml"


def packaged_spec(name: str) -> CacheSpec:
    with resources.as_file(resources.files("hkv_service") / "data" / name) as path:
        return load_spec(path)


def default_spec() -> CacheSpec:
    """The reference model's cache layout (DeepSeek-V4-style structure, CPU-sized widths)."""
    return packaged_spec(REFERENCE_SPEC)


def demo_spec() -> CacheSpec:
    """What ``hkv demo`` runs: the reference layout with a recurrent layer, so the proof covers
    every kind of cache object (the state checkpoints too)."""
    return packaged_spec(RECURRENT_SPEC)


def resolve_spec(path: str | None) -> CacheSpec:
    return default_spec() if path is None else load_spec(path)
