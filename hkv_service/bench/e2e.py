"""End-to-end benchmark: the reference-model workload through hkv, against full recompute.

Figures: reuse efficiency (reused tokens / tokens the oracle says were safely reusable) without
and with every fault; time per request split into lookup / transfer / compute; and hkv's
overhead (lookup + transfer) as a fraction of the recompute time it saved, on the longest
prompts. The baseline is recomputing every prompt from scratch, measured in the same run
(``forward_full`` in check mode).
"""

from __future__ import annotations

from typing import Any

from hkv_service.demo.run import run_workload

__all__ = ["run"]


def _split(rep: dict[str, Any]) -> dict[str, float]:
    n = max(1, rep["requests"])
    t = rep["time_s"]
    return {f"{k}_ms_per_request": round(1e3 * t.get(k, 0.0) / n, 3)
            for k in ("lookup", "transfer", "compute", "full")}


def _overhead(rep: dict[str, Any], longest: int) -> tuple[float, float]:
    rows = [r for r in rep["per_request"] if r["reused_tokens"] > 0]
    rows.sort(key=lambda r: -r["prompt_tokens"])
    rows = rows[:longest]
    cost = sum(r["lookup_s"] + r["transfer_s"] for r in rows)
    # recompute time saved: the reused tokens at this request's own full-recompute cost per token
    saved = sum(r["full_s"] * r["reused_tokens"] / r["prompt_tokens"] for r in rows)
    return cost, saved


def run(quick: bool = False) -> dict[str, Any]:
    n = 24 if quick else 96
    clean = run_workload(requests=n, seed=0, faults="none", check=True, workers=2)
    faulty = run_workload(requests=n, seed=0, faults="all", check=True, workers=2)
    cost, saved = _overhead(clean, max(4, n // 6))
    figures = {
        "requests": n,
        "reuse_efficiency_no_faults": clean["reuse_efficiency"],
        "reuse_efficiency_all_faults": faulty["reuse_efficiency"],
        "reused_fraction_no_faults": round(clean["reused_tokens"] / clean["prompt_tokens"], 4),
        "reused_fraction_all_faults": round(faulty["reused_tokens"] / faulty["prompt_tokens"], 4),
        "silent_errors": clean["silent_errors"] + faulty["silent_errors"],
        "no_faults": _split(clean),
        "all_faults": _split(faulty),
        "hkv_overhead_s_longest": round(cost, 4),
        "recompute_saved_s_longest": round(saved, 4),
    }
    baseline = {"recompute_ms_per_request": _split(clean)["full_ms_per_request"]}
    with_hkv = 1e3 * (clean["time_s"]["lookup"] + clean["time_s"]["transfer"]
                      + clean["time_s"]["compute"]) / max(1, clean["requests"])
    ratios = {
        "overhead_vs_saved_recompute": round(cost / saved, 4) if saved else None,
        "request_time_vs_recompute": round(with_hkv / baseline["recompute_ms_per_request"], 4)
        if baseline["recompute_ms_per_request"] else None,
        "reuse_vs_oracle_no_faults": clean["reuse_efficiency"],
        "reuse_vs_oracle_all_faults": faulty["reuse_efficiency"],
    }
    return {"name": "e2e", "quick": quick, "figures": figures, "baseline": baseline,
            "ratios": ratios}
