"""Where cache specs come from: a file the user names, or the reference model's packaged spec."""

from __future__ import annotations

from importlib import resources

from .core.spec import CacheSpec, load_spec

__all__ = ["REFERENCE_SPEC", "default_spec", "resolve_spec"]

REFERENCE_SPEC = "reference_spec.yaml"


def default_spec() -> CacheSpec:
    """The reference model's cache layout (DeepSeek-V4-style structure, CPU-sized widths)."""
    with resources.as_file(resources.files("hkv_service") / "data" / REFERENCE_SPEC) as path:
        return load_spec(path)


def resolve_spec(path: str | None) -> CacheSpec:
    return default_spec() if path is None else load_spec(path)
