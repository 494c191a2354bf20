"""The ``hkv`` command line. Bad usage exits 2 with one sentence; ``--help`` answers.

Subcommands: serve, up, demo, bench, stats. Handlers live next to what they drive; this
module only parses and dispatches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .settings import DEFAULT_PORT, ClientSettings, DemoSettings, ServiceSettings, SystemSettings

__all__ = ["build_parser", "main"]

BENCH_NAMES = ("core", "service", "disk", "shard", "e2e", "scale", "vllm", "route", "serve")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One sentence, exit 2 (argparse prints usage too, which buries the reason).
        sys.stderr.write(f"hkv: error: {message}. Try '{self.prog} --help'.\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hkv",
        description="hkv: a KV-cache state service for hybrid-attention LLM inference. "
        "Start with 'hkv demo' (brings the embedded system up, runs the reference workload, "
        "shuts down) or 'hkv up' (stays up).",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the metadata service (gRPC)")
    ServiceSettings.add_flags(serve)

    up = sub.add_parser("up", help="start service + shards + disk tier on Ray; stay up")
    up.add_argument("--config", default=None, help="YAML file with any of these flags as keys "
                                                   "(lookup-memo-mib: 0); flags given win")
    SystemSettings.add_flags(up)

    demo = sub.add_parser("demo", help="drive the reference-model workload and print a report")
    DemoSettings.add_flags(demo)

    bench = sub.add_parser("bench", help="measure a part against a baseline from the same run")
    bench.add_argument("name", choices=BENCH_NAMES, help="which part to measure")
    bench.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--model", default=None, help="vllm only: the model the engine runs, "
                       "'llama-hybrid' (default) or 'qwen3-next' (GatedDeltaNet states)")
    bench.add_argument("--vllm-python", default=None,
                       help="serve only: the python of a venv with vLLM (default: "
                       "$HKV_VLLM_PYTHON, this python if it has vLLM, else .venv-vllm/bin/python "
                       "beside the repository)")
    bench.add_argument("--save-min-sightings", type=int, default=None, metavar="N",
                       help="serve only: the hkv engines' connector setting save_min_sightings "
                       "(default 1: every block saved; 2: a block is saved when a second "
                       "request brings it)")
    bench.add_argument("--rounds", type=int, default=None, metavar="N",
                       help="serve only: how often each workload runs on each configuration, "
                       "alternating which goes first (default 3; 1 with --quick)")
    bench.add_argument("--doc-tokens", type=int, default=None, metavar="N",
                       help="serve only: each shared document's length in tokens, 64..3584 "
                       "(default 1024; 384 with --quick): longer documents cost vLLM alone "
                       "more prefill per miss")

    stats = sub.add_parser("stats", help="print a running service's counters")
    stats.add_argument("--endpoint", default=f"127.0.0.1:{DEFAULT_PORT}",
                       help=f"host:port (default 127.0.0.1:{DEFAULT_PORT}); a service of N "
                       "partitions: their host:port in order, comma-separated, as hkv up "
                       "prints its endpoint")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    ClientSettings.add_flags(stats)
    return parser


def _handler(command: str) -> Callable[[argparse.Namespace], int]:
    # Imported lazily: `hkv --help` must not pay for importing ray and torch.
    from . import commands

    handlers: dict[str, Callable[[argparse.Namespace], int]] = commands.HANDLERS
    return handlers[command]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _handler(args.command)(args)


if __name__ == "__main__":
    sys.exit(main())
