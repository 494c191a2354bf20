from __future__ import annotations

import json
from pathlib import Path

import pytest

from hkv_service.core.errors import (
    BadSpecField,
    SpecError,
    UnknownKind,
    WindowSmallerThanBlock,
    ZeroBlockSize,
)
from hkv_service.core.spec import load_spec, spec_from_dict


def base() -> dict:
    return {
        "model_id": "m",
        "hash_block_size": 64,
        "groups": [
            {
                "name": "c4",
                "kind": "COMPRESSED",
                "block_size": 64,
                "ratio": 4,
                "overlap": 4,
                "abi": {"dtype": "float16", "head_shape": [1, 512]},
            },
            {
                "name": "swa",
                "kind": "SWA",
                "block_size": 64,
                "window": 128,
                "abi": {"dtype": "bfloat16", "head_shape": [2, 64]},
            },
        ],
    }


def test_reference_spec_geometry(spec) -> None:
    assert spec.lcm_block_size == 128
    # resume points are multiples of 128, so of every ratio: a tail holds only the overlap
    assert spec.group("c4").tail_tokens_max == 4
    assert spec.group("c128").tail_tokens_max == 0  # no overlap: no TAIL object at all


@pytest.mark.parametrize(
    ("mutate", "error", "phrase"),
    [
        (lambda d: d["groups"][0].update(block_size=0), ZeroBlockSize, "at least 1"),
        (lambda d: d["groups"][1].update(window=32), WindowSmallerThanBlock, "smaller"),
        (lambda d: d["groups"][0].update(kind="MAMBA"), UnknownKind, "MAMBA"),
        (lambda d: d["groups"][0].update(colour="red"), BadSpecField, "colour"),
        (lambda d: d["groups"][0].update(ratio=3), BadSpecField, "multiple of ratio"),
        (lambda d: d["groups"][0]["abi"].update(dtype="int3"), BadSpecField, "dtype"),
        (lambda d: d["groups"].append(dict(d["groups"][0])), BadSpecField, "unique"),
        (lambda d: d.update(hash_block_size=0), ZeroBlockSize, "hash_block_size"),
        (lambda d: d["groups"][1].update(block_size=96), BadSpecField, "multiple of hash"),
    ],
)
def test_each_bad_spec_is_a_named_error(mutate, error, phrase) -> None:
    raw = base()
    mutate(raw)
    with pytest.raises(error, match=phrase):
        spec_from_dict(raw)


def test_load_from_json_and_yaml(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps(base()))
    assert load_spec(tmp_path / "s.json").lcm_block_size == 64
    (tmp_path / "bad.yaml").write_text("groups: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(tmp_path / "bad.yaml")
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")


def test_round_trip_through_dict(spec) -> None:
    assert spec_from_dict(spec.to_dict()) == spec


def test_abi_fingerprint_sees_every_field(spec) -> None:
    g = spec.group("c4")
    fps = {g.abi.fingerprint()}
    raw = spec.to_dict()
    for key, value in [("dtype", "float16"), ("layout", "HND"), ("kernel_version", "x")]:
        changed = json.loads(json.dumps(raw))
        changed["groups"][0]["abi"][key] = value
        fps.add(spec_from_dict(changed).group("c4").abi.fingerprint())
    assert len(fps) == 4
