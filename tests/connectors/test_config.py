"""The connector's settings and the setups it refuses to start with, each with a sentence."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm_harness import engine_config, hybrid_specs, readme_commands, write_tiny_config

from hkv_service.connectors import systems
from hkv_service.connectors.config import ConnectorConfig
from hkv_service.connectors.errors import BadConnectorConfig, ConnectorError, SpecMismatch
from hkv_service.connectors.lane import shorten_gil_switch
from hkv_service.connectors.vllm import HkvConnector, engine_geometry
from hkv_service.specs import default_spec
from workers.inprocess import InProcessSystem


def readme_kv_transfer() -> str:
    """The ``--kv-transfer-config`` of the README's ``vllm serve`` line, as written there."""
    argv = shlex.split(readme_commands()[1])
    return argv[argv.index("--kv-transfer-config") + 1]


def test_the_readme_config_loads_the_connector_class_with_hma() -> None:
    tc = KVTransferConfig(**json.loads(readme_kv_transfer()))
    cls = KVConnectorFactory.get_connector_class(tc)
    assert cls is HkvConnector and supports_hma(cls)
    cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
    assert (cfg.endpoint, cfg.ray_address, cfg.ray_namespace) == ("127.0.0.1:50051", "auto", "hkv")


@pytest.mark.parametrize(("extra", "key"), [
    ({}, "endpoint"),
    ({"endpoint": "h:1", "system": "x"}, "endpoint"),
    ({"endpoint": "h:1", "colour": "red"}, "colour"),
    ({"endpoint": "h:1", "lease_ttl_s": "long"}, "lease_ttl_s"),
    ({"endpoint": "h:1", "lease_ttl_s": 0}, "lease_ttl_s"),
    ({"endpoint": "h:1", "tls_cert": "c.pem"}, "tls_cert"),
    ({"endpoint": "h:1", "shards": 3}, "shards"),
    ({"endpoint": "h:1", "save_min_sightings": 0}, "save_min_sightings"),
    ({"endpoint": "h:1", "save_min_sightings": 256}, "save_min_sightings"),
    ({"endpoint": "h:1", "save_min_sightings": 1.5}, "save_min_sightings"),
    ({"endpoint": "h:1", "probe_step_wait_s": -0.001}, "probe_step_wait_s"),
    ({"endpoint": "h:1", "probe_step_wait_s": 2.0}, "probe_step_wait_s"),
    ({"endpoint": "h:1", "save_min_sightings": True}, "save_min_sightings"),
    ({"endpoint": "h:1", "gil_switch_interval_s": -1e-4}, "gil_switch_interval_s"),
    ({"endpoint": "h:1", "gil_switch_interval_s": 1.0}, "gil_switch_interval_s"),
])
def test_bad_extra_config_is_refused_naming_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(BadConnectorConfig) as err:
        ConnectorConfig.from_extra(extra)
    assert err.value.key == key


def test_the_gil_switch_interval_is_lowered_never_raised() -> None:
    """The connector lowers the process's switch interval to its setting (its lanes then
    get the GIL back from vLLM's engine loop within it), keeps a lower one the process has,
    and leaves it alone at 0."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert ConnectorConfig.from_extra({"endpoint": "h:1"}).gil_switch_interval_s == 5e-4
        assert shorten_gil_switch(5e-4) == pytest.approx(5e-4)
        assert shorten_gil_switch(2e-3) == pytest.approx(5e-4)  # never raised
        assert shorten_gil_switch(0.0) == pytest.approx(5e-4)  # 0: left as it is
        sys.setswitchinterval(0.005)
        assert shorten_gil_switch(0.0) == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_tiny_config(tmp_path / "tiny")


def test_a_fail_policy_is_refused(model: Path) -> None:
    cfg = engine_config(model, "none")
    assert cfg.kv_transfer_config is not None
    cfg.kv_transfer_config.kv_load_failure_policy = "fail"
    kvc = get_kv_cache_configs(cfg, [hybrid_specs()], [16 << 20])[0]
    with pytest.raises(ConnectorError, match="kv_load_failure_policy 'recompute'"):
        HkvConnector(cfg, KVConnectorRole.SCHEDULER, kvc)


def test_a_service_running_another_spec_is_refused_and_the_needed_spec_written(
        model: Path, tmp_path: Path) -> None:
    cfg = engine_config(model, "other")
    assert cfg.kv_transfer_config is not None
    out = tmp_path / "needed.yaml"
    cfg.kv_transfer_config.kv_connector_extra_config["spec_out"] = str(out)
    kvc = get_kv_cache_configs(cfg, [hybrid_specs()], [16 << 20])[0]
    system = InProcessSystem(default_spec(), tmp_path / "hkv")
    systems.publish("other", system)
    try:
        with pytest.raises(SpecMismatch) as err:
            HkvConnector(cfg, KVConnectorRole.SCHEDULER, kvc)
        assert err.value.service_model_id == "hkv-reference-v1"
        from hkv_service.core.spec import load_spec

        assert load_spec(out) == engine_geometry(cfg, kvc).spec  # what `hkv up --spec` takes
    finally:
        systems.withdraw("other")
        system.close()


def test_an_unpublished_system_is_refused(model: Path) -> None:
    cfg = engine_config(model, "nobody")
    kvc = get_kv_cache_configs(cfg, [hybrid_specs()], [16 << 20])[0]
    with pytest.raises(BadConnectorConfig, match="no in-process hkv is published"):
        HkvConnector(cfg, KVConnectorRole.WORKER, kvc)
