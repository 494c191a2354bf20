"""Offline checks of deploy/k8s: what `kubectl apply` and the KubeRay operator would reject.

* `kubectl kustomize` renders both overlays;
* every built-in object validates with kubernetes-validate, strict, against Kubernetes 1.32.0
  (the RayCluster's pod templates too, as Pods);
* the RayCluster validates against the vendored KubeRay CRD schema made strict (an object schema
  that lists `properties` gets `additionalProperties: false`), so a misspelled field fails
  where a real cluster would silently prune it;
* every `hkv ...` command line in the manifests and the Dockerfile parses with the real `hkv`
  parser, and the ports the probes, the Service and the scrape annotations use are the ones the
  container is told to serve;
* the security posture (non-root, read-only root, no capabilities, RuntimeDefault seccomp) and
  the wiring (spec ConfigMap, token Secret, data dir volumes) hold.
"""

from __future__ import annotations

import copy
import functools
import ipaddress
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hkv_service.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CRD_PATH = K8S / "crds" / "ray.io_rayclusters.yaml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
REFERENCE_SPEC = ROOT / "hkv_service" / "data" / "reference_spec.yaml"
K8S_VERSION = "1.32.0"
OVERLAYS = ("dev", "prod")
KUBECTL = shutil.which("kubectl")

needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not on PATH: cannot run `kubectl kustomize` to render"
)


# ---------------------------------------------------------------------------------- helpers


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    assert docs, f"overlay {overlay} rendered nothing"
    return docs


def objects(overlay: str, kind: str | None = None) -> list[dict[str, Any]]:
    return [copy.deepcopy(o) for o in render(overlay) if kind is None or o["kind"] == kind]


def the(overlay: str, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects(overlay, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


_REDIRECTS = {">", ">>", "<", ">&", "<&", "&>", "&>>", ">|"}
_PREFIX_WORDS = {"exec", "nohup", "env", "time", "command"}
_SHELL_OPS = {"&&", "||", ";", "|", "&", ";;", ">", ">>", "<", ">&", "<&", "(", ")", "&>"}


def hkv_invocations_in_shell(script: str) -> list[list[str]]:
    """Each `hkv ARGS...` in a shell command line, as the argv the parser would get."""
    script = re.sub(r"(?<=\s)\d+(?=[<>])", "", script)  # `2>&1`: fd numbers are not args
    lex = shlex.shlex(script, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens = list(lex)
    found: list[list[str]] = []
    for i, tok in enumerate(tokens):
        if tok != "hkv" and not tok.endswith("/bin/hkv"):
            continue
        # only in command position: first word, after an operator, or after exec/nohup/env
        k = i - 1
        while k >= 0 and (tokens[k] in _PREFIX_WORDS or re.fullmatch(r"\w+=\S*", tokens[k])):
            k -= 1
        if k >= 0 and tokens[k] not in _SHELL_OPS:
            continue
        argv: list[str] = []
        rest = iter(tokens[i + 1 :])
        for t in rest:
            if t in _REDIRECTS:  # `> file` is not an argument, but words after it are
                next(rest, None)
                continue
            if t in _SHELL_OPS or set(t) <= set("<>&|;()"):
                break
            argv.append(t)
        found.append(argv)
    return found


def hkv_invocations_in_container(c: dict[str, Any]) -> list[list[str]]:
    cmd = list(c.get("command") or []) + list(c.get("args") or [])
    found: list[list[str]] = []
    for k, word in enumerate(cmd):
        if word == "hkv" or word.endswith("/bin/hkv"):  # exec form: ["hkv", "up", ...]
            found.append(cmd[k + 1 :])
            break
        if re.search(r"(^|[\s;&|/])hkv\s", word):  # a shell script in args
            found.extend(hkv_invocations_in_shell(word))
    return found


def parse_hkv(argv: list[str]) -> Any:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:  # pragma: no cover - the failure message is the point
        pytest.fail(f"`hkv {shlex.join(argv)}` does not parse (exit {e.code})")


def pod_templates(overlay: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) for every pod the overlay would create."""
    out = []
    for rc in objects(overlay, "RayCluster"):
        name = rc["metadata"]["name"]
        out.append((f"RayCluster/{name} head", rc["spec"]["headGroupSpec"]["template"]))
        for g in rc["spec"].get("workerGroupSpecs", []):
            out.append((f"RayCluster/{rc['metadata']['name']} {g['groupName']}", g["template"]))
    for kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        for o in objects(overlay, kind):
            out.append((f"{kind}/{o['metadata']['name']}", o["spec"]["template"]))
    return out


def head(overlay: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(head pod template, its ray-head container, parsed `hkv up` args)."""
    rc = the(overlay, "RayCluster", "hkv")
    tpl = rc["spec"]["headGroupSpec"]["template"]
    (container,) = [c for c in tpl["spec"]["containers"] if hkv_invocations_in_container(c)]
    (argv,) = hkv_invocations_in_container(container)
    return tpl, container, parse_hkv(argv)


def port_of(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"named port {port!r} is not declared by container {container['name']}"
    return int(named[port])


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_UNITS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def quantity_bytes(q: str | int) -> int:
    m = _QUANTITY.match(str(q))
    assert m, f"unsupported quantity {q!r}"
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ------------------------------------------------------------------ the strict CRD schema


def strict_schema(node: Any) -> Any:
    """The CRD schema with unknown fields rejected and Kubernetes extensions made JSON Schema."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: strict_schema(v) for k, v in node.items() if k not in ("x-kubernetes-validations",)
    }  # CEL rules: the API server's job
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crd_v1_schema() -> dict[str, Any]:
    crd = yaml.load(CRD_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["spec"]["names"]["kind"] == "RayCluster"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


@functools.cache
def raycluster_validator() -> jsonschema.protocols.Validator:
    schema = strict_schema(_crd_v1_schema())
    cls = jsonschema.validators.Draft7Validator
    cls.check_schema(schema)
    return cls(schema)


def validate_raycluster(obj: dict[str, Any]) -> None:
    assert obj["apiVersion"] == "ray.io/v1", obj["apiVersion"]
    errors = sorted(raycluster_validator().iter_errors(obj), key=lambda e: list(e.path))
    if errors:
        raise jsonschema.ValidationError(
            "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5])
        )


# ------------------------------------------------------------------------------ rendering


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_expected_objects(overlay: str) -> None:
    kinds = {o["kind"] for o in render(overlay)}
    for kind in (
        "Namespace",
        "ServiceAccount",
        "ConfigMap",
        "PersistentVolumeClaim",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "RayCluster",
    ):
        assert kind in kinds, f"{overlay} renders no {kind}"
    # nothing that holds a real secret is rendered; the CRD is installed by the operator
    assert "Secret" not in kinds
    assert "CustomResourceDefinition" not in kinds
    ns = the(overlay, "Namespace")["metadata"]["name"]
    assert ns == f"hkv-{overlay}"
    for o in render(overlay):
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == ns, f"{o['kind']}/{o['metadata']['name']}"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_objects_validate_strict_k8s_1_32(overlay: str) -> None:
    checked = 0
    for o in render(overlay):
        if o["apiVersion"].startswith("ray.io/"):
            continue
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(map(str, e.path))
            pytest.fail(f"{overlay}: {o['kind']}/{o['metadata']['name']}: {where}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{overlay}: no 1.32 schema for a built-in object: {e.message}")
        checked += 1
    assert checked >= 8


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_raycluster_pod_templates_validate_as_pods(overlay: str) -> None:
    for where, tpl in pod_templates(overlay):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "x", **tpl.get("metadata", {})},
            "spec": tpl["spec"],
        }
        try:
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay} {where}: {'.'.join(map(str, e.path))}: {e.message}")


def test_strict_pod_validation_rejects_a_misspelled_field() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x"},
        "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolicyy": "Always"}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


# ----------------------------------------------------------------------- RayCluster vs CRD


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_raycluster_validates_against_vendored_crd(overlay: str) -> None:
    (rc,) = objects(overlay, "RayCluster")
    try:
        validate_raycluster(rc)
    except jsonschema.ValidationError as e:
        pytest.fail(f"{overlay}: RayCluster: {e.message}")


@needs_kubectl
@pytest.mark.parametrize(
    "path, bad_key",
    [
        (("spec",), "workerGroupSpec"),  # missing the s
        (("spec", "headGroupSpec"), "rayStartParam"),
        (("spec", "workerGroupSpecs", 0), "replica"),
        (("spec", "headGroupSpec", "template", "spec", "containers", 0), "readinesProbe"),
        (
            ("spec", "headGroupSpec", "template", "spec", "containers", 0, "securityContext"),
            "readOnlyRootFileSystem",
        ),
    ],
)
def test_misspelled_raycluster_field_is_rejected(path: tuple[Any, ...], bad_key: str) -> None:
    (rc,) = objects("dev", "RayCluster")
    node: Any = rc
    for p in path:
        node = node[p]
    node[bad_key] = node.get(bad_key, {} if bad_key != "replica" else 1)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(bad_key)):
        validate_raycluster(rc)
    # ...which the CRD's own (structural, pruning) schema would have let through silently.
    assert jsonschema.validators.Draft7Validator(_crd_v1_schema()).is_valid(rc)


@needs_kubectl
def test_raycluster_wrong_type_and_missing_required_are_rejected() -> None:
    (rc,) = objects("dev", "RayCluster")
    bad = copy.deepcopy(rc)
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_raycluster(bad)
    bad = copy.deepcopy(rc)
    del bad["spec"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        validate_raycluster(bad)


def test_strict_schema_handles_kubernetes_extensions() -> None:
    schema = strict_schema(
        {
            "type": "object",
            "properties": {
                "q": {"x-kubernetes-int-or-string": True},
                "free": {
                    "type": "object",
                    "properties": {"a": {"type": "string"}},
                    "x-kubernetes-preserve-unknown-fields": True,
                },
                "m": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "x-kubernetes-validations": [{"rule": "self.q > 0"}],
        }
    )
    v = jsonschema.validators.Draft7Validator(schema)
    assert v.is_valid({"q": 3, "free": {"a": "x", "other": 1}, "m": {"k": "v"}})
    assert v.is_valid({"q": "50%"})
    assert not v.is_valid({"q": [1]})
    assert not v.is_valid({"typo": 1})
    assert not v.is_valid({"m": {"k": 1}})
    assert "x-kubernetes-validations" not in schema


# -------------------------------------------------------------- hkv command lines and ports


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_hkv_command_line_parses(overlay: str) -> None:
    seen = 0
    for _where, tpl in pod_templates(overlay):
        for c in tpl["spec"].get("containers", []) + tpl["spec"].get("initContainers", []):
            for argv in hkv_invocations_in_container(c):
                args = parse_hkv(argv)
                seen += 1
                if args.command in ("serve", "up"):
                    host = args.host
                    loopback = host in ("localhost",) or ipaddress.ip_address(host).is_loopback
                    assert loopback or args.auth_token_file or args.tls_cert or args.insecure, (
                        f"{overlay}: hkv binds {host} without a token, TLS or --insecure"
                    )
                    assert not args.insecure or overlay == "dev", "--insecure outside dev"
    assert seen >= 1, f"{overlay}: no `hkv` command line found: nothing was checked"


@needs_kubectl
def test_a_bogus_flag_in_a_manifest_is_caught() -> None:
    _tpl, container, _args = head("dev")
    script = container["args"][0].replace("--metrics-port", "--metric-prt")
    (argv,) = hkv_invocations_in_shell(script)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2


def test_shell_extraction() -> None:
    s = (
        "ulimit -n 65536 2>/dev/null || true; ray start --head && exec hkv up --port 1 "
        "--grace-s 5 > log 2>&1 --data-dir '/a b' & echo hkv $! > pid; "
        "X=1 nohup /opt/hkv/bin/hkv serve --insecure 2>x"
    )
    assert hkv_invocations_in_shell(s) == [
        ["up", "--port", "1", "--grace-s", "5", "--data-dir", "/a b"],
        ["serve", "--insecure"],
    ]
    assert hkv_invocations_in_container({"command": ["hkv", "serve"], "args": ["--port", "2"]}) == [
        ["serve", "--port", "2"]
    ]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_service_and_scrape_ports_match_the_served_ports(overlay: str) -> None:
    tpl, c, args = head(overlay)
    assert args.command == "up" and args.address == "auto"
    assert args.port != 0 and args.metrics_port != 0
    assert port_of(c, "grpc") == args.port
    assert port_of(c, "metrics") == args.metrics_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in c, f"{overlay}: head has no {probe}"
        assert "grpc" in c[probe], f"{overlay}: {probe} is not the native gRPC probe"
        assert c[probe]["grpc"]["port"] == args.port, f"{overlay}: {probe} port"
    ann = tpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == args.metrics_port
    assert ann["prometheus.io/path"] == "/metrics"

    svc = the(overlay, "Service", "hkv")
    assert matches(svc["spec"]["selector"], tpl["metadata"]["labels"])
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50051
    # every metadata partition (--service-replicas) is declared, exposed and admitted
    for i in range(args.service_replicas):
        grpc_name, metrics_name = ("grpc", "metrics") if i == 0 else (f"grpc-{i}",
                                                                      f"metrics-{i}")
        assert grpc_name in ports and metrics_name in ports, f"{overlay}: partition {i}"
        assert ports[grpc_name]["port"] == 50051 + i
        assert port_of(c, ports[grpc_name]["targetPort"]) == args.port + i
        assert port_of(c, ports[metrics_name]["targetPort"]) == args.metrics_port + i
    assert len(ports) == 2 * args.service_replicas, f"{overlay}: ports {sorted(ports)}"

    np = the(overlay, "NetworkPolicy", "hkv-metadata-service")
    assert matches(np["spec"]["podSelector"]["matchLabels"], tpl["metadata"]["labels"])
    grpc_rules = [
        r
        for r in np["spec"]["ingress"]
        if any(p["port"] in (args.port, "grpc") for p in r.get("ports", []))
    ]
    assert grpc_rules, "no NetworkPolicy rule admits the gRPC port"
    admitted = {p["port"] for r in grpc_rules for p in r.get("ports", [])}
    partitions = set(range(args.port, args.port + args.service_replicas))
    assert partitions <= admitted, f"{overlay}: gRPC ports admitted {admitted}"
    for rule in grpc_rules:
        for peer in rule["from"]:
            assert peer["podSelector"]["matchLabels"] == {"hkv.io/role": "inference-worker"}


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_head_files_come_from_the_right_volumes(overlay: str) -> None:
    tpl, c, args = head(overlay)
    volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}

    def volume_for(path: str) -> tuple[dict[str, Any], str]:
        best = max(
            (m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")),
            key=len,
            default=None,
        )
        assert best is not None, f"{overlay}: {path} is on no mounted volume"
        return mounts[best], path[len(best) :].lstrip("/")

    vol, key = volume_for(args.spec)
    assert vol["configMap"]["name"] == "hkv-cache-spec"
    cm = the(overlay, "ConfigMap", "hkv-cache-spec")
    assert key in cm["data"]
    assert yaml.safe_load(cm["data"][key]) == yaml.safe_load(REFERENCE_SPEC.read_text()), (
        "deploy/k8s/base/cache-spec.yaml drifted from hkv_service/data/reference_spec.yaml"
    )

    vol, key = volume_for(args.auth_token_file)
    assert vol["secret"]["secretName"] == "hkv-auth"
    assert [i["path"] for i in vol["secret"]["items"]] == [key]

    vol, _ = volume_for(args.data_dir)
    claim = vol["persistentVolumeClaim"]["claimName"]
    the(overlay, "PersistentVolumeClaim", claim)

    # Shards get the same --data-dir: every worker mounts node-local storage there.
    rc = the(overlay, "RayCluster", "hkv")
    for g in rc["spec"]["workerGroupSpecs"]:
        wvols = {v["name"]: v for v in g["template"]["spec"]["volumes"]}
        (wc,) = g["template"]["spec"]["containers"]
        (m,) = [m for m in wc["volumeMounts"] if m["mountPath"] == args.data_dir]
        wv = wvols[m["name"]]
        assert "emptyDir" in wv or "ephemeral" in wv, "disk tier must be node-local"
        size = (
            wv["emptyDir"]["sizeLimit"]
            if "emptyDir" in wv
            else wv["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]["storage"]
        )
        assert args.disk_budget_bytes <= quantity_bytes(size), (
            f"{overlay}: --disk-budget-bytes exceeds the {g['groupName']} disk-tier volume"
        )


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down(overlay: str) -> None:
    for where, tpl in pod_templates(overlay):
        spec = tpl["spec"]
        psc = spec.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, where
        assert psc.get("runAsUser", 0) != 0, where
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert spec.get("automountServiceAccountToken") is False, where
        for v in spec.get("volumes", []):
            assert not {"hostPath", "nfs"} & set(v), f"{where}: volume {v['name']}"
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}/{c['name']}"
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{c['name']}"
            assert not sc.get("capabilities", {}).get("add"), f"{where}/{c['name']}"
            assert "limits" in c.get("resources", {}), f"{where}/{c['name']} has no limits"
            assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


@needs_kubectl
def test_overlays_differ_as_intended() -> None:
    def gpus(overlay: str) -> list[int]:
        rc = the(overlay, "RayCluster", "hkv")
        return [
            int(
                g["template"]["spec"]["containers"][0]["resources"]["limits"].get(
                    "nvidia.com/gpu", 0
                )
            )
            for g in rc["spec"]["workerGroupSpecs"]
        ]

    def workers(overlay: str) -> int:
        rc = the(overlay, "RayCluster", "hkv")
        return sum(g["replicas"] for g in rc["spec"]["workerGroupSpecs"])

    assert gpus("dev") == [0] and all(n >= 1 for n in gpus("prod"))
    assert workers("dev") == 1 and workers("prod") > workers("dev")
    assert head("prod")[2].disk_budget_bytes > head("dev")[2].disk_budget_bytes


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_select_real_pods(overlay: str) -> None:
    labels = [tpl["metadata"]["labels"] for _w, tpl in pod_templates(overlay)]
    for pdb in objects(overlay, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(matches(sel, lab) for lab in labels), pdb["metadata"]["name"]


# ------------------------------------------------------------------------------ Dockerfile


def _dockerfile_stages() -> dict[str, list[str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if m:
            current = m.group(1) or f"stage{len(stages)}"
            stages[current] = []
        elif current is not None:
            stages[current].append(line)
    return stages


def test_dockerfile_final_images_are_non_root_without_build_tools() -> None:
    stages = _dockerfile_stages()
    for target in ("service", "shard"):
        body = " ".join(stages[target])
        assert "USER 10001:10001" in stages[target], target
        for tool in ("build-essential", "gcc", "g++", "git ", "-dev "):
            assert tool not in body, f"{target} installs {tool.strip()}"
        assert "COPY --from=build-" in body
    assert "build-essential" in " ".join(stages["build-base"])


def test_dockerfile_default_command_parses() -> None:
    import json

    lines = _dockerfile_stages()["service"]
    entry = json.loads(next(x for x in lines if x.startswith("ENTRYPOINT"))[len("ENTRYPOINT") :])
    cmd = json.loads(next(x for x in lines if x.startswith("CMD"))[len("CMD") :])
    (argv,) = hkv_invocations_in_container({"command": entry, "args": cmd})
    args = parse_hkv(argv)
    assert args.command == "serve" and args.auth_token_file


def test_versions_agree_across_deploy_files() -> None:
    ray_pin = re.search(r"^ARG RAY_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M)
    torch_pin = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert ray_pin and torch_pin
    constraints = (ROOT / "deploy" / "docker" / "constraints.txt").read_text()
    assert f"\nray=={ray_pin.group(1)}\n" in constraints
    rc = yaml.safe_load((K8S / "base" / "raycluster.yaml").read_text())
    assert rc["spec"]["rayVersion"] == ray_pin.group(1)
    cluster = (ROOT / "deploy" / "ray" / "cluster.yaml").read_text()
    assert f"ray[default]=={ray_pin.group(1)}" in cluster
    assert f"torch=={torch_pin.group(1)}" in cluster
