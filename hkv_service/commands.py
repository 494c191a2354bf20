"""Subcommand handlers, imported lazily by ``hkv_service.cli`` (so ``--help`` stays fast).

Each handler takes the parsed namespace and returns the process exit code.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["HANDLERS"]


def _serve(args: argparse.Namespace) -> int:
    from .server.serve import run_serve

    return run_serve(args)


def _up(args: argparse.Namespace) -> int:
    from .up import run_up

    return run_up(args)


def _demo(args: argparse.Namespace) -> int:
    from .demo.run import run_demo

    return run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def _stats(args: argparse.Namespace) -> int:
    from .client.stats_cmd import run_stats

    return run_stats(args)


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": _serve,
    "up": _up,
    "demo": _demo,
    "bench": _bench,
    "stats": _stats,
}
