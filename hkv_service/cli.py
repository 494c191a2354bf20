"""The ``hkv`` command line. Bad usage exits 2 with one sentence; ``--help`` answers.

Subcommands: serve, up, demo, bench, stats. Handlers live next to what they drive; this
module only parses and dispatches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

__all__ = ["build_parser", "main"]

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 0  # 0 = no Prometheus endpoint unless asked for
BENCH_NAMES = ("core", "service", "disk", "shard", "e2e")
DEFAULT_SEGMENT_BLOCKS = 64  # core.segments' (not imported: --help stays fast); a test ties them


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One sentence, exit 2 (argparse prints usage too, which buries the reason).
        sys.stderr.write(f"hkv: error: {message}. Try '{self.prog} --help'.\n")
        sys.exit(2)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0 = pick a free one)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="Prometheus /metrics port (default: off)")
    p.add_argument("--data-dir", default="hkv-data",
                   help="folder for the LMDB disk tier and service state (default ./hkv-data)")
    p.add_argument("--spec", default=None,
                   help="cache spec YAML/JSON (default: the reference model's spec)")
    p.add_argument("--auth-token-file", default=None,
                   help="file holding a shared token clients must send (metadata 'authorization')")
    p.add_argument("--tls-cert", default=None, help="server certificate (PEM); enables TLS")
    p.add_argument("--tls-key", default=None, help="server private key (PEM)")
    p.add_argument("--tls-ca", default=None, help="CA bundle (PEM); requires client certs (mTLS)")
    p.add_argument("--tls-allowed-cn", default=None,
                   help="comma-separated client certificate CNs allowed (needs --tls-ca); "
                        "others get PERMISSION_DENIED")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind without TLS or token (logs a warning)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                   help="an owner silent this long has its objects marked lost (default 10)")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="seconds in-flight RPCs get to finish on shutdown (default 5)")
    p.add_argument("--max-inflight-objects", type=int, default=64,
                   help="admission cap: objects in transit between tiers at once (default 64)")
    p.add_argument("--max-inflight-bytes", type=int, default=256 << 20,
                   help="admission cap: bytes in transit between tiers at once (default 256 MiB)")
    p.add_argument("--lookup-memo-mib", type=int, default=64,
                   help="memory for answers to repeated long lookups, kept until their prefix "
                        "changes (the lookup memo; 0 = off; default 64)")
    p.add_argument("--walk-segment-blocks", type=int, default=None,
                   help="blocks per walk segment: runs of this many blocks walked whole twice "
                        "are taken whole by later lookups through them (a multiple of the "
                        "spec's period, 2 for the reference spec; 0 = off; default: the "
                        f"first multiple of the period from {DEFAULT_SEGMENT_BLOCKS})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hkv",
        description="hkv: a KV-cache state service for hybrid-attention LLM inference. "
        "Start with 'hkv demo' (brings the embedded system up, runs the reference workload, "
        "shuts down) or 'hkv up' (stays up).",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the metadata service (gRPC)")
    _add_server_flags(serve)

    up = sub.add_parser("up", help="start service + shards + disk tier on Ray; stay up")
    _add_server_flags(up)
    up.add_argument("--address", default=None,
                    help="join an existing Ray cluster ('auto' or ray://host:port); "
                         "default starts a local Ray instance")
    up.add_argument("--config", default=None, help="YAML file with any of these flags as keys")
    up.add_argument("--blocks-per-group", type=int, default=256,
                    help="blocks each shard allocates per cache group (default 256)")
    up.add_argument("--disk-budget-bytes", type=int, default=1 << 30,
                    help="byte budget of each node's disk tier (default 1 GiB)")
    up.add_argument("--shards-per-node", type=int, default=1, help="shard actors per node")

    demo = sub.add_parser("demo", help="drive the reference-model workload and print a report")
    demo.add_argument("--endpoint", default=None,
                      help="host:port of a running service (default: start the embedded system)")
    demo.add_argument("--requests", type=int, default=48, help="requests to run (default 48)")
    demo.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    demo.add_argument("--seed", type=int, default=0, help="fixes workload and faults")
    demo.add_argument("--faults", default="none",
                      help="'none', 'all', or a comma list of fault names (name or name=rate)")
    demo.add_argument("--check", action="store_true",
                      help="compare every output with a full recompute; exit 1 on any mismatch")
    demo.add_argument("--workers", type=int, default=2, help="concurrent inference workers")
    demo.add_argument("--json", action="store_true", help="print one JSON object")

    bench = sub.add_parser("bench", help="measure a part against a baseline from the same run")
    bench.add_argument("name", choices=BENCH_NAMES, help="which part to measure")
    bench.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")

    stats = sub.add_parser("stats", help="print a running service's counters")
    stats.add_argument("--endpoint", default=f"127.0.0.1:{DEFAULT_PORT}", help="host:port")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.add_argument("--auth-token-file", default=None,
                       help="token file, if the server wants one")
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
