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
    import sys

    from workers.launcher import ConfigError, config_from_args, run_up, serve_argv

    from .cli import build_parser
    from .server.serve import UsageError
    from .server.serve import config_from_args as serve_config

    # The service's own flags are checked before Ray starts, exactly as the service will
    # get them (serve_argv: the spawned process and the --address actor alike): a bad
    # --port or --host is exit 2 with its sentence, not exit 1 after a minute.
    try:
        argv = serve_argv(config_from_args(args))
        serve_config(build_parser().parse_args(argv[argv.index("serve"):]))
    except (ConfigError, UsageError) as exc:
        sys.stderr.write(f"hkv up: error: {exc}\n")
        return 2
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
