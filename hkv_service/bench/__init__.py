"""``hkv bench NAME``: each bench measures its part and a baseline in the same run.

Every bench module has ``run(quick: bool) -> dict`` returning ``{"name", "quick", "figures",
"baseline", "ratios"}``; ``ratios`` maps each comparison to ours/baseline. No bench asserts a
wall-clock limit: the machine is shared and noisy, so ratios are what we report. A bench may
add ``failed_guards``, a sentence per budget or ratio guard its run broke (``core``: the
metadata budget and the lookup's ratio guards, in its quick run): the command then says
them on stderr and exits 1, so CI fails with them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

__all__ = ["run_bench"]


# flags of hkv bench serve alone, with the range of a number (None: not a number)
SERVE_ONLY: dict[str, tuple[int | None, int | None]] = {
    "vllm_python": (None, None), "save_min_sightings": (1, 255), "rounds": (1, 20),
    # (the model's 4,096 positions hold the longest conversation over the longest document)
    "doc_tokens": (64, 3584)}


def _print_human(result: dict[str, Any]) -> None:
    print(f"hkv bench {result['name']}{' (quick)' if result.get('quick') else ''}")
    for section in ("figures", "baseline", "ratios"):
        print(f"  {section}:")
        for key, value in result.get(section, {}).items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"    {key:<40} {shown}")


def run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"hkv_service.bench.{args.name}")
    extra: dict[str, Any] = {}
    if getattr(args, "model", None) is not None:  # only a bench that runs a model takes one
        if args.name != "vllm":
            sys.stderr.write(f"hkv bench {args.name}: --model is for hkv bench vllm only\n")
            return 2
        extra["model"] = args.model
    for flag, (low, high) in SERVE_ONLY.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        name = "--" + flag.replace("_", "-")
        if args.name != "serve":
            sys.stderr.write(f"hkv: error: {name} applies to 'hkv bench serve' only.\n")
            return 2
        if low is not None and not low <= value <= high:
            sys.stderr.write(f"hkv: error: {name} must be {low}..{high}.\n")
            return 2
        extra[flag] = value
    result: dict[str, Any] = module.run(quick=args.quick, **extra)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        _print_human(result)
    sys.stdout.flush()
    failed = result.get("failed_guards") or []
    for sentence in failed:
        print(f"hkv bench {result['name']}: {sentence}", file=sys.stderr)
    return 1 if failed else 0
