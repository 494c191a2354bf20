"""hkv_service/settings.py: each setting defined once; flags, config keys and argv derived."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from hkv_service.cli import build_parser
from hkv_service.settings import (
    ClientSettings,
    DemoSettings,
    ServiceSettings,
    SettingsError,
    SystemSettings,
    flag_of,
    is_loopback,
)


def _sub(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if a.choices and name in a.choices)
    parser: argparse.ArgumentParser = action.choices[name]  # type: ignore[index]
    return parser


def _flags(name: str) -> set[str]:
    return {o for a in _sub(name)._actions for o in a.option_strings} - {"-h", "--help"}


def _setting_flags(cls: Any) -> set[str]:
    return {flag_of(f.name) for f in cls.flag_fields()}


def test_each_command_offers_exactly_its_settings() -> None:
    assert _flags("serve") == _setting_flags(ServiceSettings)
    assert _flags("up") == _setting_flags(SystemSettings) | {"--config"}
    assert _flags("stats") == _setting_flags(ClientSettings) | {"--endpoint", "--json"}
    assert _flags("demo") == _setting_flags(DemoSettings)
    assert _setting_flags(ServiceSettings) < _setting_flags(SystemSettings)


@pytest.mark.parametrize("cls", [ServiceSettings, SystemSettings, ClientSettings,
                                 DemoSettings])
def test_every_setting_has_help_and_parsed_defaults_are_the_fields(cls: Any) -> None:
    for f in fields(cls):
        assert len(f.metadata["help"]) > 10, f.name
    name = {ServiceSettings: "serve", SystemSettings: "up", ClientSettings: "stats",
            DemoSettings: "demo"}[cls]
    assert cls.from_args(build_parser().parse_args([name])) == cls()


def _away_from_defaults(d: Path) -> ServiceSettings:
    """A ServiceSettings whose every field differs from its default (and is valid)."""
    return ServiceSettings(
        host="0.0.0.0", port=1234, metrics_port=9464, spec=str(d / "s.yaml"),
        auth_token_file=str(d / "t"), tls_cert=str(d / "c"), tls_key=str(d / "k"),
        tls_ca=str(d / "ca"), tls_allowed_cn=("a", "b"), insecure=True,
        heartbeat_timeout_s=2.5, grace_s=0.25, max_inflight_objects=3, max_inflight_bytes=7,
        max_owners=5, lookup_memo_mib=0, walk_segment_blocks=0, partition="1/3",
        range_blocks=4, kv_events_port=5557, kv_events_host="0.0.0.0",
        kv_events_topic="kv@p{partition}@m", kv_events_form="array")


def test_to_argv_gives_the_same_object_back(tmp_path: Path) -> None:
    settings = _away_from_defaults(tmp_path)
    for f in fields(ServiceSettings):
        assert getattr(settings, f.name) != f.default, f.name
    assert ServiceSettings.from_argv(settings.to_argv()) == settings
    assert ServiceSettings.from_argv(ServiceSettings().to_argv()) == ServiceSettings()
    # the serve parser reads the same argv the same way
    args = build_parser().parse_args(["serve", *settings.to_argv()])
    assert ServiceSettings.from_args(args) == settings


def test_system_settings_hand_over_their_service_part(tmp_path: Path) -> None:
    # hkv up sets each replica's partition itself (launcher.replica_settings)
    service = replace(_away_from_defaults(tmp_path), partition="0/1")
    system = SystemSettings(**{f.name: getattr(service, f.name) for f in fields(service)},
                            tls_client_cert="cc", tls_client_key="ck", data_dir="/d")
    assert type(system.service()) is ServiceSettings and system.service() == service


def test_partitions_are_checked_and_hkv_up_sets_them_per_replica() -> None:
    from workers.launcher import replica_settings

    for bad, needle in [("3/3", "0 <= I < N"), ("x", "I/N"), ("0/65", "N <= 64")]:
        with pytest.raises(SettingsError, match=needle):
            ServiceSettings(partition=bad)
    with pytest.raises(SettingsError, match="--service-replicas"):
        SystemSettings(partition="1/2")
    with pytest.raises(SettingsError, match="--service-replicas must be between 1 and 64"):
        SystemSettings(service_replicas=65)
    system = SystemSettings(service_replicas=3, port=7000, metrics_port=9000)
    replicas = [replica_settings(system, i) for i in range(3)]
    assert [(r.partition, r.port, r.metrics_port) for r in replicas] == [
        ("0/3", 7000, 9000), ("1/3", 7001, 9001), ("2/3", 7002, 9002)]
    assert [replica_settings(SystemSettings(port=0), 0).port] == [0]  # 0: each picks a port
    assert replicas[2].state_config().partition.index == 2


def test_config_mapping_coerces_and_refuses() -> None:
    values = SystemSettings.from_mapping(
        {"lookup-memo-mib": 0, "grace_s": 2, "tls-allowed-cn": ["x", "y"], "insecure": True,
         "walk-segment-blocks": None, "host": "0.0.0.0"}, "--config f")
    assert values == {"lookup_memo_mib": 0, "grace_s": 2.0, "tls_allowed_cn": ("x", "y"),
                      "insecure": True, "walk_segment_blocks": None, "host": "0.0.0.0"}
    for raw, needle in [({"bogus": 1}, "unknown key 'bogus'"),
                        ({"num-cpus": 2}, "unknown key 'num-cpus'"),  # set from code only
                        ({"port": "abc"}, "port must be an integer, got 'abc'"),
                        ({"port": True}, "port must be an integer"),
                        ({"insecure": "yes"}, "insecure must be true or false"),
                        ({"tls_allowed_cn": 3}, "must be a list of names")]:
        with pytest.raises(SettingsError, match=needle):
            SystemSettings.from_mapping(raw, "--config f")


def test_flags_given_win_over_the_file_even_at_their_default() -> None:
    file = {"port": 7000, "grace_s": 2.0}
    args = build_parser().parse_args(["up", "--port", "50051"])
    got = SystemSettings.from_args(args, file)
    assert got.port == 50051 and got.grace_s == 2.0


@pytest.mark.parametrize(("values", "needle"), [
    ({"port": 70000}, "--port must be between 0 and 65535, got 70000"),
    ({"host": " "}, "--host must not be empty"),
    ({"host": "10.0.0.1"}, "refusing to bind non-loopback address 10.0.0.1"),
    ({"tls_key": "k"}, "--tls-cert and --tls-key must be given together"),
    ({"tls_ca": "ca"}, "--tls-ca (mTLS) needs --tls-cert and --tls-key"),
    ({"tls_allowed_cn": ("a",)}, "--tls-allowed-cn needs mTLS"),
    ({"heartbeat_timeout_s": 0.0}, "--heartbeat-timeout-s must be > 0"),
    ({"lookup_memo_mib": -1}, "--lookup-memo-mib must not be negative"),
])
def test_a_bad_value_cannot_make_an_object(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(SettingsError) as err:
        ServiceSettings(**values)
    assert needle in str(err.value)


@pytest.mark.parametrize(("values", "needle"), [
    ({"host": "0.0.0.0"}, "refusing to bind non-loopback"),  # --address too: same object
    ({"tls_cert": "c", "tls_key": "k", "tls_ca": "ca"}, "give --tls-client-cert"),
    ({"tls_client_cert": "c"}, "--tls-client-cert and --tls-client-key must be given"),
    ({"tls_client_cert": "c", "tls_client_key": "k"}, "need --tls-ca (mTLS)"),
    ({"tls_server_name": "x"}, "--tls-server-name needs --tls-cert"),
    ({"blocks_per_group": 0}, "--blocks-per-group must be a positive integer"),
])
def test_system_rules(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        SystemSettings(address="auto", **values)


def test_guarded_binds() -> None:
    assert ServiceSettings(host="0.0.0.0", auth_token_file="t").guarded
    assert ServiceSettings(host="0.0.0.0", tls_cert="c", tls_key="k").guarded
    assert not ServiceSettings(host="0.0.0.0", insecure=True).guarded
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.com"))


def test_load_reads_and_checks_what_the_settings_name(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("  s3cret \n")
    for name in ("c", "k", "ca", "cc", "ck"):
        (tmp_path / name).write_bytes(name.encode())
    system = SystemSettings(auth_token_file=str(token), tls_cert=str(tmp_path / "c"),
                            tls_key=str(tmp_path / "k"), tls_ca=str(tmp_path / "ca"),
                            tls_client_cert=str(tmp_path / "cc"),
                            tls_client_key=str(tmp_path / "ck"), tls_server_name="svc")
    inputs = system.load()
    assert (inputs.token, inputs.tls_cert, inputs.tls_key, inputs.tls_ca) == \
        ("s3cret", b"c", b"k", b"ca")
    assert inputs.spec.model_id == "hkv-reference-v1"
    creds = system.credentials(inputs)
    assert creds.token == "s3cret" and creds.tls is not None
    # hkv up's clients trust the service's own certificate and present theirs (mTLS)
    assert (creds.tls.ca, creds.tls.cert, creds.tls.key, creds.tls.server_name) == \
        (b"c", b"cc", b"ck", "svc")
    assert SystemSettings().credentials(SystemSettings().load()).tls is None
    token.write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        system.load()
    with pytest.raises(SettingsError, match="--walk-segment-blocks: segment_blocks"):
        ServiceSettings(walk_segment_blocks=3).load()
    with pytest.raises(SettingsError, match="--spec: cannot read cache spec"):
        ServiceSettings(spec=str(tmp_path / "none.yaml")).load()


def test_client_settings_imply_tls(tmp_path: Path) -> None:
    (tmp_path / "ca").write_bytes(b"ca")
    assert ClientSettings().load().tls is None
    assert ClientSettings(tls=True).load().tls is not None  # the system's roots
    tls = ClientSettings(tls_ca=str(tmp_path / "ca"), tls_server_name="n").load().tls
    assert tls is not None and (tls.ca, tls.server_name) == (b"ca", "n")
    with pytest.raises(SettingsError, match=r"--tls-ca \S+ is not a readable file"):
        ClientSettings(tls_ca=str(tmp_path / "nope")).load()


def test_kv_events_bind_loopback_unless_insecure() -> None:
    assert ServiceSettings(kv_events_port=5557).kv_events_host == "127.0.0.1"
    with pytest.raises(SettingsError, match="KV events on non-loopback"):
        ServiceSettings(kv_events_port=5557, kv_events_host="0.0.0.0")
    ServiceSettings(kv_events_port=5557, kv_events_host="0.0.0.0", insecure=True)
    with pytest.raises(SettingsError, match="map or array"):
        ServiceSettings(kv_events_form="json")
