"""deploy/ray/cluster.yaml: passes the checks `ray up` runs, and its `hkv` lines parse.

`prepare_config` merges the provider's defaults (a YAML file shipped inside ray for aws: no
network, no cloud credentials) and `validate_config` checks the result against Ray's
ray-schema.json plus its cross-field rules. Nothing is launched.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from hkv_service.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAMLS = sorted((ROOT / "deploy" / "ray").glob("*.yaml"))

pytest.importorskip("ray.autoscaler._private.util", reason="ray is a runtime dependency")
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

_OPS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "(", ")"}
_REDIRECTS = {">", ">>", "<", ">&", "<&", "&>", "&>>", ">|"}
_PREFIX = {"exec", "nohup", "env", "time", "command"}


def load(path: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load(path.read_text())
    return cfg


def hkv_argvs(script: str) -> list[list[str]]:
    script = re.sub(r"(?<=\s)\d+(?=[<>])", "", script)  # `2>&1`: fd numbers are not args
    lex = shlex.shlex(script, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    toks = list(lex)
    out = []
    for i, t in enumerate(toks):
        if t != "hkv" and not t.endswith("/bin/hkv"):
            continue
        k = i - 1
        while k >= 0 and toks[k] in _PREFIX:
            k -= 1
        if k >= 0 and toks[k] not in _OPS:
            continue
        argv = []
        rest = iter(toks[i + 1 :])
        for a in rest:
            if a in _REDIRECTS:  # `> file` is not an argument, but words after it are
                next(rest, None)
                continue
            if a in _OPS or set(a) <= set("<>&|;()"):
                break
            argv.append(a)
        out.append(argv)
    return out


def all_commands(cfg: dict[str, Any]) -> list[str]:
    keys = (
        "initialization_commands",
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    )
    cmds = [c for k in keys for c in cfg.get(k, [])]
    for nt in cfg.get("available_node_types", {}).values():
        cmds += nt.get("worker_setup_commands", []) + nt.get("initialization_commands", [])
    return cmds


def test_there_is_a_cluster_yaml() -> None:
    assert ROOT / "deploy" / "ray" / "cluster.yaml" in CLUSTER_YAMLS


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_prepare_and_validate_config(path: Path) -> None:
    cfg = load(path)
    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    # the node types we declared survive the merge with the provider defaults
    assert set(prepared["available_node_types"]) == set(cfg["available_node_types"])
    head = prepared["head_node_type"]
    assert prepared["available_node_types"][head]["max_workers"] == 0
    gpu_types = [n for n, t in cfg["available_node_types"].items() if n != head]
    assert gpu_types, "no worker node type"


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_undeclared_head_node_type_fails(path: Path) -> None:
    cfg = load(path)
    cfg["head_node_type"] = "no.such.type"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(prepare_config(cfg))


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_unknown_top_level_key_fails(path: Path) -> None:
    cfg = load(path)
    cfg["head_start_ray_command"] = ["ray start --head"]  # missing 's'
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(cfg))


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_hkv_lines_parse_and_head_runs_the_service(path: Path) -> None:
    cfg = load(path)
    parser = build_parser()
    found = [argv for c in all_commands(cfg) for argv in hkv_argvs(c)]
    assert found, "no `hkv` command line found: nothing was checked"
    for argv in found:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"`hkv {shlex.join(argv)}` does not parse (exit {e.code})")
        if args.command in ("up", "serve") and args.host not in ("127.0.0.1", "localhost", "::1"):
            assert args.auth_token_file or args.tls_cert, "non-loopback bind without auth"
            assert not args.insecure
    ups = [argv for c in cfg["head_start_ray_commands"] for argv in hkv_argvs(c)]
    assert len(ups) == 1 and ups[0][0] == "up"
    up = parser.parse_args(ups[0])
    assert up.address == "auto"
    # the security group lets workers reach every metadata partition's port
    rules = cfg.get("provider", {}).get("security_group", {}).get("IpPermissions", [])
    for port in range(up.port, up.port + up.service_replicas):
        assert any(r["FromPort"] <= port <= r["ToPort"] for r in rules), f"port {port} closed"
    # `ray start --head` comes before `hkv up --address auto` joins it
    starts = cfg["head_start_ray_commands"]
    i_ray = next(i for i, c in enumerate(starts) if "ray start --head" in c)
    i_hkv = next(i for i, c in enumerate(starts) if hkv_argvs(c))
    assert i_ray < i_hkv


def test_a_bogus_flag_is_caught() -> None:
    cfg = load(ROOT / "deploy" / "ray" / "cluster.yaml")
    (line,) = [c for c in cfg["head_start_ray_commands"] if hkv_argvs(c)]
    (argv,) = hkv_argvs(line.replace("--grace-s", "--grace"))
    argv = [*argv, "--no-such-flag"]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
