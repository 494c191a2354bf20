"""``hkv bench route --quick`` (issue 39): on both hybrid specs (SWA + full, recurrent +
full), routing by hkv's usable-token answer recomputes fewer tokens than routing by raw
full-attention block counts from events, and both report against round robin from the same
run."""

from __future__ import annotations

from hkv_service.bench import route


def test_hkv_answer_beats_raw_block_counts_on_hybrid_specs() -> None:
    out = route.run(quick=True)
    ratios, figures = out["ratios"], out["figures"]
    for spec in ("swa", "recurrent"):
        assert f"{spec}_round_robin_recomputed_tokens" in out["baseline"]
        assert f"{spec}_hkv_recomputed_vs_round_robin" in ratios
    for spec in ("swa", "recurrent"):
        assert figures[f"{spec}_hkv_recomputed_tokens"] < \
            figures[f"{spec}_block_counts_recomputed_tokens"]
        assert ratios[f"{spec}_hkv_recomputed_vs_block_counts"] < 1.0
        assert f"{spec}_round_robin_recomputed_tokens" in out["baseline"]
        assert figures[f"{spec}_hkv_resumable_share"] >= \
            figures[f"{spec}_block_counts_resumable_share"]
