"""The reference model as an oracle: cached == recomputed, and every cache object matters."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

import hkv_service
from hkv_service.core.spec import CacheSpec, load_spec, spec_from_dict
from hkv_service.refmodel import (
    LOGITS_ATOL,
    LOGITS_RTOL,
    BlockRun,
    ModelCache,
    RefModel,
    RefModelConfig,
)
from hkv_service.refmodel.cache import check_integrity

SPEC_PATH = Path(hkv_service.__file__).parent / "data" / "reference_spec.yaml"
Blocks = dict[str, Mapping[int, torch.Tensor]]
Tails = dict[str, tuple[torch.Tensor, int]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def spec() -> CacheSpec:
    return load_spec(SPEC_PATH)


@pytest.fixture(scope="module")
def model(spec: CacheSpec) -> RefModel:
    return RefModel(spec)


@pytest.fixture(scope="module")
def selecting(spec: CacheSpec) -> RefModel:
    """top_k 512 as pure selection (no score bias): the indexer matters only by what it keeps."""
    return RefModel(spec, RefModelConfig(index_bias=0.0))


def tokens(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def export_all(m: RefModel, cache: ModelCache) -> tuple[Blocks, Tails]:
    blocks: Blocks = {}
    for g in m.spec.groups:
        first = cache.swa_lo // g.block_size if g.name == "swa" else 0
        ks = range(first, cache.length // g.block_size)
        blocks[g.name] = {k: m.export_block(cache, g.name, k) for k in ks}
    return blocks, {g: m.export_tail(cache, g) for g in ("c4", "c128")}


def resume(m: RefModel, toks: torch.Tensor, p: int, blocks: Blocks, tails: Tails) -> torch.Tensor:
    return m.extend(m.import_cache(p, blocks, tails), toks[p:])[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ---- an independent, per-token implementation straight from the definitions ---------------


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _softmax_mix(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, bias: torch.Tensor):
    return torch.softmax(keys @ q / math.sqrt(q.shape[0]) + bias, 0) @ vals


def _pool(kv: torch.Tensor, j: int, r: int, ov: int, pw) -> tuple[torch.Tensor, torch.Tensor]:
    pos = [s for s in range(r * j - ov, r * j + r) if s >= 0]
    slot = torch.tensor([s - (r * j - ov) for s in pos])
    wts = torch.softmax(kv[pos, 0] @ pw.gate + pw.pos_bias[slot], 0)
    return wts, kv[pos]


def naive_logits(m: RefModel, toks: torch.Tensor) -> torch.Tensor:
    w, n = m.weights, toks.shape[0]

    def kv_of(x, aw):
        return (x @ aw.wkv).view(n, 2, -1).float().double()

    h = w.emb[toks]
    x = _rms(h)
    kv, q = kv_of(x, w.swa), x @ w.swa.wq
    rows = []
    for t in range(n):
        lo = max(0, t - 128)
        rows.append(
            _softmax_mix(q[t], kv[lo : t + 1, 0], kv[lo : t + 1, 1], torch.zeros(t + 1 - lo))
        )
    h = h + torch.stack(rows) @ w.swa.wo
    h = h + _naive_compressed(m, _rms(h), kv_of(_rms(h), w.sparse), 4, 4, True)
    h = h + _naive_compressed(m, _rms(h), kv_of(_rms(h), w.heavy), 128, 0, False)
    return (_rms(h) @ w.out).float()


def _naive_compressed(m: RefModel, x, kv, r: int, ov: int, sparse: bool) -> torch.Tensor:
    w = m.weights
    aw, pw = (w.sparse, w.sparse_pool) if sparse else (w.heavy, w.heavy_pool)
    ents, keys = [], []
    for j in range(x.shape[0] // r):
        wts, win = _pool(kv, j, r, ov, pw)
        ents.append((wts[:, None, None] * win).sum(0).float().double())
        feat = torch.tanh(win.flatten(1) @ w.indexer.feat)
        keys.append((wts[:, None] * feat).sum(0).float().double())
    q, rows = x @ aw.wq, []
    for t in range(x.shape[0]):
        e = (t + 1) // r
        bias = torch.zeros(e, dtype=torch.float64)
        if sparse and e:
            score = torch.stack(keys[:e]) @ (x[t] @ w.indexer.wq)
            keep = score.topk(min(e, m.config.top_k)).indices
            bias = torch.full((e,), float("-inf"), dtype=torch.float64)
            bias[keep] = m.config.index_bias * score[keep]
        ek = torch.stack([z[0] for z in ents[:e]]) if e else torch.zeros(0, 16, dtype=torch.float64)
        ev = torch.stack([z[1] for z in ents[:e]]) if e else torch.zeros(0, 16, dtype=torch.float64)
        keys_t, vals_t = (
            torch.cat([ek, kv[r * e : t + 1, 0]]),
            torch.cat([ev, kv[r * e : t + 1, 1]]),
        )
        full_bias = torch.cat([bias, torch.zeros(t + 1 - r * e, dtype=torch.float64)])
        rows.append(_softmax_mix(q[t], keys_t, vals_t, full_bias))
    return torch.stack(rows) @ aw.wo


@pytest.mark.parametrize(("top_k", "index_bias"), [(512, 1.0), (6, 1.0), (6, 0.0)])
def test_matches_the_definitions(spec: CacheSpec, top_k: int, index_bias: float) -> None:
    m = RefModel(spec, RefModelConfig(top_k=top_k, index_bias=index_bias))
    toks = tokens(300, seed=3)
    torch.testing.assert_close(m.forward_full(toks), naive_logits(m, toks), rtol=1e-5, atol=1e-5)


# ---- cached == recomputed -------------------------------------------------------------------


def test_prefill_logits_equal_forward_full(model: RefModel) -> None:
    toks = tokens(700)
    logits, cache = model.prefill(toks)
    assert logits.shape == (700, 64) and logits.dtype == torch.float32
    assert torch.equal(logits, model.forward_full(toks))
    assert cache.length == 700
    check_integrity(cache, model.geometry)


@pytest.mark.parametrize(("n", "p"), [(600, 128), (600, 256), (2600, 2048), (2600, 2304)])
def test_resume_from_imported_cache_is_bit_equal(model: RefModel, n: int, p: int) -> None:
    toks = tokens(n)
    full = model.forward_full(toks)
    blocks, tails = export_all(model, model.prefill(toks[:p])[1])
    assert torch.equal(resume(model, toks, p, blocks, tails), full[p:])


def test_decoding_one_token_at_a_time_matches(model: RefModel) -> None:
    toks = tokens(330)
    full = model.forward_full(toks)
    _, cache = model.prefill(toks[:200])  # a non-multiple: both tails non-empty
    rows = []
    for i in range(200, 330):  # crosses 256, where a c128 entry completes
        logits, cache = model.extend(cache, toks[i : i + 1])
        rows.append(logits)
    torch.testing.assert_close(torch.cat(rows), full[200:], rtol=LOGITS_RTOL, atol=LOGITS_ATOL)


def test_greedy_generate_follows_recomputed_argmax(model: RefModel) -> None:
    toks = tokens(150)
    generated, cache = model.greedy_generate(model.prefill(toks)[1], 5)
    seq = torch.cat([toks, torch.tensor(generated)])
    assert generated == [int(x) for x in model.forward_full(seq)[149:154].argmax(-1)]
    assert cache.length == 155


def test_export_import_round_trip(model: RefModel) -> None:
    cache = model.prefill(tokens(640))[1]
    blocks, tails = export_all(model, cache)
    back = model.import_cache(640, blocks, tails)
    check_integrity(back, model.geometry)
    assert back.swa_lo == 512 and back.last_logits is None
    again, tails2 = export_all(model, back)
    for g in ("c4", "idx", "c128"):
        assert all(torch.equal(again[g][k], blocks[g][k]) for k in blocks[g])
    assert all(torch.equal(again["swa"][k], blocks["swa"][k]) for k in (8, 9))
    assert all(
        torch.equal(tails2[g][0], tails[g][0]) and tails2[g][1] == tails[g][1] for g in tails
    )


def test_shapes(model: RefModel) -> None:
    assert model.block_shape("c4") == (16, 2, 16)
    assert model.block_shape("c128") == (1, 2, 16)
    assert model.block_shape("swa") == (64, 2, 16)
    assert model.block_shape("idx") == (16, 1, 8)
    assert model.tail_shape("c4") == (7, 2, 16)
    assert model.tail_shape("c128") == (127, 2, 16)
    cache = model.prefill(tokens(131))[1]  # c4 tail [124, 131), c128 tail [128, 131)
    assert model.export_tail(cache, "c4")[1] == 7
    assert model.export_tail(cache, "c128")[1] == 3
    assert model.export_tail(model.prefill(tokens(128))[1], "c4")[1] == 4


def test_seed_determines_the_weights(spec: CacheSpec) -> None:
    toks = tokens(200)
    a = RefModel(spec, RefModelConfig(seed=5)).forward_full(toks)
    assert torch.equal(a, RefModel(spec, RefModelConfig(seed=5)).forward_full(toks))
    assert max_diff(a, RefModel(spec, RefModelConfig(seed=6)).forward_full(toks)) > 0.1


# ---- every cache object matters --------------------------------------------------------------


@dataclasses.dataclass
class Scenario:
    model: RefModel
    toks: torch.Tensor
    p: int
    full: torch.Tensor  # forward_full(toks)[p:]
    blocks: Blocks
    tails: Tails
    stale_blocks: Blocks  # the same positions, exported after a different prompt
    stale_tails: Tails

    def diff(self, blocks: Blocks | None = None, tails: Tails | None = None) -> float:
        out = resume(self.model, self.toks, self.p, blocks or self.blocks, tails or self.tails)
        return max_diff(out, self.full)


def make_scenario(m: RefModel, n: int, p: int) -> Scenario:
    toks, other = tokens(n), tokens(p, seed=99)
    blocks, tails = export_all(m, m.prefill(toks[:p])[1])
    stale_blocks, stale_tails = export_all(m, m.prefill(other)[1])
    full = m.forward_full(toks)[p:]
    return Scenario(m, toks, p, full, blocks, tails, stale_blocks, stale_tails)


@pytest.fixture(scope="module")
def short(model: RefModel) -> Scenario:
    """640 tokens resumed at 512: 128 c4 entries, all kept by top-512 (the score bias path)."""
    return make_scenario(model, 640, 512)


@pytest.fixture(scope="module")
def long(selecting: RefModel) -> Scenario:
    """2600 tokens resumed at 2304: 576+ c4 entries, top-512 *selects* (no score bias)."""
    return make_scenario(selecting, 2600, 2304)


def _swap_block(s: Scenario, group: str, k: int, how: str) -> Blocks:
    blocks = {g: dict(d) for g, d in s.blocks.items()}
    blocks[group][k] = (
        torch.zeros_like(blocks[group][k]) if how == "zero" else s.stale_blocks[group][k]
    )
    return blocks


def _blocks_in_window(s: Scenario, group: str) -> list[int]:
    ks = sorted(s.blocks[group])
    return ks[-2:] if group == "swa" else [ks[0], ks[len(ks) // 2], ks[-1]]


@pytest.mark.parametrize("how", ["zero", "stale"])
@pytest.mark.parametrize("group", ["c4", "idx", "c128", "swa"])
@pytest.mark.parametrize("which", ["short", "long"])
def test_a_bad_block_changes_the_continuation(
    which: str, group: str, how: str, request: pytest.FixtureRequest
) -> None:
    s: Scenario = request.getfixturevalue(which)
    assert s.diff() == 0.0
    for k in _blocks_in_window(s, group):
        assert s.diff(blocks=_swap_block(s, group, k, how)) > 1e-3, (group, k)


@pytest.mark.parametrize("how", ["zero", "stale"])
@pytest.mark.parametrize("which", ["short", "long"])
def test_a_bad_c4_tail_changes_the_continuation(
    which: str, how: str, request: pytest.FixtureRequest
) -> None:
    s: Scenario = request.getfixturevalue(which)
    tensor, count = s.tails["c4"]
    assert count == 4  # compressor state at a block boundary: tokens [p-4, p)
    bad = torch.zeros_like(tensor) if how == "zero" else s.stale_tails["c4"][0]
    assert s.diff(tails={**s.tails, "c4": (bad, count)}) > 1e-3


def test_a_bad_c128_tail_changes_the_continuation(model: RefModel) -> None:
    toks = tokens(400)
    full = model.forward_full(toks)[300:]
    _, cache = model.prefill(toks[:300])  # c128 tail: tokens [256, 300)
    assert cache.heavy.tail.shape[0] == 44
    bad_tail = torch.zeros_like(cache.heavy.tail)
    bad = dataclasses.replace(cache, heavy=dataclasses.replace(cache.heavy, tail=bad_tail))
    assert torch.equal(model.extend(cache, toks[300:])[0], full)
    assert max_diff(model.extend(bad, toks[300:])[0], full) > 1e-3


def test_top_k_selects_past_2048_tokens(spec: CacheSpec, long: Scenario) -> None:
    everything = RefModel(spec, RefModelConfig(top_k=10**6, index_bias=0.0))
    assert max_diff(everything.forward_full(long.toks)[long.p :], long.full) > 1e-3


def test_swa_blocks_outside_the_window_are_not_needed(short: Scenario) -> None:
    blocks = {**short.blocks, "swa": {k: short.blocks["swa"][k] for k in (6, 7)}}
    assert short.diff(blocks=blocks) == 0.0
    gone = {**short.blocks, "swa": {k: torch.zeros(64, 2, 16) for k in range(6)} | blocks["swa"]}
    assert short.diff(blocks=gone) == 0.0


def _runs(blocks: Blocks, only: range | None = None) -> Blocks:
    """Each group's blocks as one BlockRun (``only``: just those block indices of every group
    that has them)."""
    out: Blocks = {}
    for g, d in blocks.items():
        ks = sorted(k for k in d if only is None or k in only)
        out[g] = BlockRun(ks[0], torch.stack([d[k] for k in ks]))
    return out


@pytest.mark.parametrize("which", ["short", "long"])
def test_block_runs_import_bit_equal(which: str, request: pytest.FixtureRequest) -> None:
    s: Scenario = request.getfixturevalue(which)
    runs = _runs(s.blocks)
    assert s.diff(blocks=runs) == 0.0
    a = s.model.import_cache(s.p, s.blocks, s.tails)
    b = s.model.import_cache(s.p, runs, s.tails)
    for x, y in ((a.swa_kv, b.swa_kv), (a.sparse.entries, b.sparse.entries),
                 (a.sparse.index_keys, b.sparse.index_keys), (a.heavy.entries, b.heavy.entries)):
        assert x is not None and y is not None and torch.equal(x, y)
    check_integrity(b, s.model.geometry)
    # a run wider than needed (swa blocks outside the window) is read block by block
    assert len(runs["swa"]) > 2 and s.diff(blocks=runs) == 0.0


def test_block_run_is_a_mapping_of_its_blocks(short: Scenario) -> None:
    run = _runs(short.blocks)["c4"]
    assert list(run) == sorted(short.blocks["c4"]) and len(run) == len(short.blocks["c4"])
    assert all(torch.equal(run[k], short.blocks["c4"][k]) for k in run)
    assert 99 not in run and run.get(99) is None
    with pytest.raises(ValueError, match="dimension 0"):
        BlockRun(0, torch.tensor(1.0))


def test_block_runs_that_miss_or_misshape_are_named(short: Scenario) -> None:
    m, p, b, t = short.model, short.p, short.blocks, short.tails
    late = {**_runs(b), "c4": _runs(b, range(1, 8))["c4"]}
    with pytest.raises(ValueError, match="'c4' block 0 is missing"):
        m.import_cache(p, late, t)
    double = {**_runs(b), "c128": BlockRun(0, _runs(b)["c128"].stacked.double())}
    with pytest.raises(ValueError, match="'c128' block 0 must be float32"):
        m.import_cache(p, double, t)
    gap = torch.stack([b["idx"][k] for k in range(7)])
    with pytest.raises(ValueError, match="'idx' block 7 is missing"):
        m.import_cache(p, {**_runs(b), "idx": BlockRun(0, gap)}, t)


# ---- the caller's mistakes --------------------------------------------------------------------


def test_import_names_what_is_missing_or_misshapen(short: Scenario) -> None:
    m, p, b, t = short.model, short.p, short.blocks, short.tails
    cases = [
        ({**b, "c4": {k: v for k, v in b["c4"].items() if k != 3}}, t, "'c4' block 3 is missing"),
        ({**b, "swa": {6: b["swa"][6]}}, t, "'swa' block 7 is missing"),
        ({**b, "idx": {**b["idx"], 0: torch.zeros(16, 2, 8)}}, t, "'idx' block 0 must be"),
        ({**b, "c128": {**b["c128"], 1: b["c128"][1].double()}}, t, "'c128' block 1 must be"),
        (b, {"c128": t["c128"]}, "'c4' at length 512 is missing"),
        (b, {**t, "c4": (t["c4"][0][:3], 4)}, "'c4' must be float32"),
        (b, {**t, "c4": (t["c4"][0], 3)}, "must hold 4 tokens, got 3"),
    ]
    for blocks, tails, message in cases:
        with pytest.raises(ValueError, match=message):
            m.import_cache(p, blocks, tails)
    with pytest.raises(ValueError, match="multiple of 128"):
        m.import_cache(p - 64, b, t)


def test_export_refuses_what_the_cache_cannot_give(model: RefModel) -> None:
    cache = model.prefill(tokens(200))[1]
    with pytest.raises(ValueError, match="block 3 covers tokens up to 256"):
        model.export_block(cache, "c4", 3)
    with pytest.raises(ValueError, match="unknown cache group"):
        model.export_block(cache, "nope", 0)
    with pytest.raises(ValueError, match="has no tail"):
        model.export_tail(cache, "swa")
    imported = model.import_cache(128, *export_all(model, model.prefill(tokens(128))[1]))
    with pytest.raises(ValueError, match="has no last logits"):
        model.greedy_generate(imported, 1)


def test_bad_tokens_and_specs_are_refused(spec: CacheSpec, model: RefModel) -> None:
    with pytest.raises(ValueError, match="token ids"):
        model.forward_full(torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="1-D integer"):
        model.forward_full(torch.zeros(2, 2, dtype=torch.int64))
    raw = spec.to_dict()
    raw["groups"] = [g for g in raw["groups"] if g["kind"] != "SWA"]
    with pytest.raises(ValueError, match="exactly one SWA"):
        RefModel(spec_from_dict(raw))
