"""The vLLM connector's tests: they need vLLM, which only ``.venv-vllm`` has (``.ci/vllm``).

Without vLLM the whole directory is left out of collection (and says so in the header);
with it, every test here carries the ``vllm`` marker.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HERE = Path(__file__).parent

if not HAVE_VLLM:
    collect_ignore_glob = ["test_*.py", "vllm_harness.py"]


def pytest_report_header(config: pytest.Config) -> str | None:
    if HAVE_VLLM:
        return None
    return "tests/connectors: vllm is not importable here, not collected (run .ci/vllm)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
