"""The reference model's recurrent layer (issue 37): a gated linear recurrence whose state at a
resume point is one fixed-size object. Resuming from the state as of exactly p is bit-equal to
a full pass; a state one boundary off, in another dtype, or missing changes the logits."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hkv_service.core.spec import spec_from_dict
from hkv_service.refmodel import LOGITS_ATOL, LOGITS_RTOL, ModelCache, RefModel
from hkv_service.refmodel.cache import check_integrity
from hkv_service.specs import default_spec, demo_spec

T = 520


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> RefModel:
    return RefModel(demo_spec())


@pytest.fixture(scope="module")
def toks() -> torch.Tensor:
    return torch.randint(0, 64, (T,), generator=torch.Generator().manual_seed(11))


def _blocks(m: RefModel, cache: ModelCache, p: int) -> tuple[Any, Any]:
    geo = m.geometry
    out = {g.name: {k: m.export_block(cache, g.name, k) for k in range(p // g.block_size)}
           for g in (geo.sparse, geo.heavy, geo.index, geo.swa)}
    return out, {g: m.export_tail(cache, g) for g in ("c4", "c128")}


def _resume(m: RefModel, toks: torch.Tensor, p: int, state: torch.Tensor | None
            ) -> torch.Tensor:
    _, at_p = m.prefill(toks[:p])
    blocks, tails = _blocks(m, at_p, p)
    states = {} if state is None else {"gla": state}
    return m.extend(m.import_cache(p, blocks, tails, states), toks[p:])[0]


def _state_at(m: RefModel, toks: torch.Tensor, p: int) -> torch.Tensor:
    return m.export_state(m.prefill(toks[:p])[1], "gla")


def naive_recurrent(m: RefModel, x: torch.Tensor) -> torch.Tensor:
    """Layer 3 token by token from its definition (float64 throughout, u rounded to float32)."""
    w = m.weights.recurrent
    assert w is not None
    geo = m.geometry
    dk, kern = geo.key_dim, geo.conv_kernel
    u = (x @ w.wu).float().double()
    u = torch.cat([torch.zeros(kern - 1, u.shape[1], dtype=torch.float64), u])
    s = torch.zeros(dk, geo.value_dim, dtype=torch.float64)
    rows = []
    for t in range(x.shape[0]):
        c = torch.nn.functional.silu((u[t : t + kern] * w.conv).sum(0))
        k, v = c[:dk] / math.sqrt(dk), c[dk:]
        a = torch.sigmoid(x[t] @ w.wa + w.a_bias)
        s = a[:, None] * s + torch.outer(k, v)
        o = (x[t] @ w.wq) @ s
        rows.append(o * torch.rsqrt(o.pow(2).mean() + 1e-6) @ w.wo)
    return torch.stack(rows)


def test_the_layer_matches_its_definition(model: RefModel) -> None:
    # one chunk (no state rounding inside it): the closed form equals the recurrence
    x = torch.randn(100, model.config.d_model, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(3))
    from hkv_service.refmodel.cache import empty_state
    from hkv_service.refmodel.recurrent import recurrent_layer

    state = empty_state(model.geometry, model.device)
    assert state is not None and model.weights.recurrent is not None
    out, after = recurrent_layer(state, x, model.weights.recurrent)
    assert torch.allclose(out, naive_recurrent(model, x), rtol=1e-9, atol=1e-9)
    assert after.conv.dtype == after.ssm.dtype == torch.float32
    assert tuple(after.conv.shape) == (3, 32) and tuple(after.ssm.shape) == (16, 16)


@pytest.mark.parametrize("p", [128, 256, 384, 512])
def test_resume_from_the_state_at_p_is_bit_equal(model: RefModel, toks: torch.Tensor,
                                                 p: int) -> None:
    full = model.forward_full(toks)
    assert torch.equal(_resume(model, toks, p, _state_at(model, toks, p)), full[p:])


def test_decoding_one_token_at_a_time_matches(model: RefModel, toks: torch.Tensor) -> None:
    full = model.forward_full(toks[:300])
    _, cache = model.prefill(toks[:200])
    rows = []
    for t in range(200, 300):
        lg, cache = model.extend(cache, toks[t : t + 1])
        rows.append(lg)
    check_integrity(cache, model.geometry)
    assert torch.allclose(torch.cat(rows), full[200:], rtol=LOGITS_RTOL, atol=LOGITS_ATOL)


@pytest.mark.parametrize("wrong", ["one boundary earlier", "one boundary later", "float16",
                                   "bfloat16", "zeros"])
def test_a_wrong_state_changes_the_continuation(model: RefModel, toks: torch.Tensor,
                                                wrong: str) -> None:
    p = 256
    right = _state_at(model, toks, p)
    state = {
        "one boundary earlier": lambda: _state_at(model, toks, p - 128),
        "one boundary later": lambda: _state_at(model, toks, p + 128),
        "float16": lambda: right.half().float(),
        "bfloat16": lambda: right.bfloat16().float(),
        "zeros": lambda: torch.zeros_like(right),
    }[wrong]()
    got = _resume(model, toks, p, state)
    full = model.forward_full(toks)[p:]
    assert not torch.allclose(got, full, rtol=LOGITS_RTOL, atol=LOGITS_ATOL), wrong
    # not only the first tokens: the slow decay carries a wrong state far past p
    late = (got - full)[128:].abs().amax(-1)
    assert int((late > LOGITS_ATOL).sum()) > 64, wrong


def test_import_needs_the_state_at_p(model: RefModel, toks: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="state of group 'gla' at length 256 is missing"):
        _resume(model, toks, 256, None)
    right = _state_at(model, toks, 256)
    with pytest.raises(ValueError, match="must be float32"):
        _resume(model, toks, 256, right.half())
    with pytest.raises(ValueError, match="must be float32"):
        _resume(model, toks, 256, right[:-1])
    assert model.block_shape("gla") == (3 * 32 + 16 * 16,)
    with pytest.raises(ValueError, match="RECURRENT"):
        model.export_block(model.prefill(toks[:128])[1], "gla", 0)


def test_the_attention_layers_keep_their_weights() -> None:
    # the recurrent layer's weights are drawn last: the attention-only model is unchanged
    plain, hybrid = RefModel(default_spec()), RefModel(demo_spec())
    assert plain.weights.recurrent is None and hybrid.weights.recurrent is not None
    for name in ("emb", "out"):
        assert torch.equal(getattr(plain.weights, name), getattr(hybrid.weights, name))
    assert torch.equal(plain.weights.sparse.wkv, hybrid.weights.sparse.wkv)


def test_a_recurrent_group_the_layer_cannot_hold_is_refused() -> None:
    raw = demo_spec()
    groups = [
        {"name": g.name, "kind": g.kind.value, "block_size": g.block_size, "ratio": g.ratio,
         "overlap": g.overlap, "window": g.window,
         **({"indexes": g.indexes} if g.indexes else {}),
         "abi": {"dtype": g.abi.dtype, "layout": g.abi.layout.split("|")[0],
                 "head_shape": list(g.abi.head_shape), "kernel_version": g.abi.kernel_version}}
        for g in raw.groups if g.kind.value != "RECURRENT"]
    bad = {"name": "gla", "kind": "RECURRENT", "block_size": 128, "state_kind": "GLA",
           "state": [{"shape": [3, 32], "dtype": "bfloat16"}, {"shape": [16, 16],
                                                               "dtype": "float32"}],
           "abi": {"dtype": "float32", "layout": "x", "head_shape": [16, 16],
                   "kernel_version": "gla-1"}}
    spec = spec_from_dict({"model_id": "m", "hash_block_size": 64, "groups": [*groups, bad]})
    with pytest.raises(ValueError, match="recurrent layer keeps one layer's state"):
        RefModel(spec)
