"""``hkv stats``: a running service's counters, and which kind's transition rate jumped.

The service's counters are monotone, so rates come from samples taken ``SAMPLE_GAP_S`` apart.
:func:`rate_jumps` is pure: the last interval's rate of each kind is compared with the mean
rate of the earlier intervals, and flagged when it is more than ``factor`` times that mean
and above ``floor`` transitions/s (so an idle service's 0 -> 1 is not an alarm)::

    samples:   s0 ---- s1 ---- s2 ---- s3
    rates:        r1      r2      r3        mean(r1, r2) vs r3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hkv_service.core.errors import HkvError, Unavailable
from hkv_service.settings import ClientSettings, Credentials, SettingsError

from .client import MetadataClient

__all__ = ["RateJump", "kind_totals", "rate_jumps", "run_stats"]

SAMPLES = 4
SAMPLE_GAP_S = 0.5
JUMP_FACTOR = 4.0
JUMP_FLOOR_PER_S = 5.0


@dataclass(frozen=True, slots=True)
class RateJump:
    kind: str
    rate_per_s: float  # last interval
    mean_per_s: float  # mean of the earlier intervals
    ratio: float  # rate / mean (inf when the mean is 0)


def kind_totals(transitions: Mapping[str, int]) -> dict[str, int]:
    """Sum ``"KIND:STATE" -> n`` counters per kind."""
    out: dict[str, int] = {}
    for key, n in transitions.items():
        kind = key.partition(":")[0]
        out[kind] = out.get(kind, 0) + n
    return out


def _rates(samples: Sequence[tuple[float, Mapping[str, int]]], kind: str) -> list[float]:
    out = []
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        dt = t1 - t0
        out.append((c1.get(kind, 0) - c0.get(kind, 0)) / dt if dt > 0 else 0.0)
    return out


def rate_jumps(samples: Sequence[tuple[float, Mapping[str, int]]],
               factor: float = JUMP_FACTOR, floor: float = JUMP_FLOOR_PER_S) -> list[RateJump]:
    """Kinds whose last-interval rate exceeds ``factor`` x the earlier mean and ``floor``.

    ``samples`` are ``(time_s, {kind: monotone count})``, oldest first; at least three are
    needed (two intervals) to say anything.
    """
    if len(samples) < 3:
        return []
    kinds = sorted({k for _, counts in samples for k in counts})
    out = []
    for kind in kinds:
        rates = _rates(samples, kind)
        last, earlier = rates[-1], rates[:-1]
        mean = sum(earlier) / len(earlier)
        if last > floor and last > factor * mean:
            out.append(RateJump(kind, last, mean, last / mean if mean > 0 else float("inf")))
    return out


def _sample(client: Any) -> tuple[dict[str, object], dict[str, int]]:
    stats = client.stats()
    transitions = stats.get("transitions", {})
    assert isinstance(transitions, Mapping)
    return stats, kind_totals(transitions)


def _print_table(stats: Mapping[str, object], rates: Mapping[str, float],
                 jumps: Sequence[RateJump]) -> None:
    flagged = {j.kind for j in jumps}
    for section in ("gauges", "lookups", "transitions", "downgrades", "evictions", "events"):
        values = stats.get(section, {})
        assert isinstance(values, Mapping)
        print(f"{section}:")
        if not values:
            print("  (none)")
        for key in sorted(values):
            print(f"  {key:<40} {values[key]:>12}")
    print("transition rate per kind (last interval):")
    if not any(rates.values()):
        print("  (no transitions: idle)")
    for kind in sorted(k for k, r in rates.items() if r):
        mark = "  <-- JUMP" if kind in flagged else ""
        print(f"  {kind:<40} {rates[kind]:>10.1f}/s{mark}")


def _client(endpoint: str, creds: Credentials) -> Any:
    """One service, or its partitions (``HOST:P0,HOST:P1``, as ``hkv up`` prints them): their
    stats summed, each partition's under ``partitions``."""
    if "," not in endpoint:
        return MetadataClient(endpoint, token=creds.token, tls=creds.tls, timeout_s=3.0)
    from workers.local import connect

    return connect(endpoint, creds.token, 3.0, creds.tls)


def run_stats(args: argparse.Namespace) -> int:
    try:
        creds = ClientSettings.from_args(args).load()
    except SettingsError as err:
        sys.stderr.write(f"hkv stats: error: {err}\n")
        return 2
    samples: list[tuple[float, dict[str, int]]] = []
    try:
        with _client(args.endpoint, creds) as client:
            for i in range(SAMPLES):
                if i:
                    time.sleep(SAMPLE_GAP_S)
                stats, totals = _sample(client)
                samples.append((time.monotonic(), totals))
    except Unavailable:
        tls = "do --tls-* match its TLS" if creds.tls else "does it want TLS (--tls-ca)"
        sys.stderr.write(f"hkv stats: cannot read stats from {args.endpoint}: no hkv service "
                         f"answers there (is it running, is this its host:port, {tls}?)\n")
        return 1
    except HkvError as err:
        sys.stderr.write(f"hkv stats: cannot read stats from {args.endpoint}: {err}\n")
        return 1
    jumps = rate_jumps(samples)
    rates = {k: r[-1] for k in samples[-1][1] if (r := _rates(samples, k))}
    try:
        if args.json:
            print(json.dumps({"endpoint": args.endpoint, "stats": stats, "rates_per_s": rates,
                              "rate_jumps": [asdict(j) for j in jumps]}, sort_keys=True))
        else:
            _print_table(stats, rates, jumps)
        sys.stdout.flush()
    except BrokenPipeError:  # `hkv stats | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
