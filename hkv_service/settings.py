"""The settings of each process role, each defined once: name, type, default, help, check.

A setting is one dataclass field. Everything else is derived from the fields, so a setting
cannot be known on one path and missing on another::

    field  --add_flags-->  CLI flags (hkv serve, hkv up, hkv stats)
           --from_args-->  the object, from flags (+ hkv up's --config file: from_mapping)
           --to_argv---->  the argv of the `hkv serve` process hkv up spawns
           (the object itself is what the --address service actor is given)

    ServiceSettings      the metadata service: hkv serve, the process hkv up spawns, the
      |                  --address actor
      +- SystemSettings  hkv up: the service's settings + Ray, shards, and the credentials of
                         hkv up's own clients (workers.launcher.SystemConfig)
    ClientSettings       a client of the service (hkv stats): token and TLS
    DemoSettings         hkv demo: the workload, its faults, the wiring it runs on

Values are checked when an object is made (``__post_init__``): one that exists is valid, and a
bad value is :class:`SettingsError` with one sentence naming the flag. What the settings name
on disk (token, certificates, the cache spec, and the walk segment size the spec must take) is
read and checked once by ``load``, before anything starts; its result travels with the
settings (to the --address actor, whose node and working directory may differ).

This module imports only the standard library at import time: ``hkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable, Iterator, Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

# the service's tunables' defaults: an import-free module of the core (--help stays fast)
from hkv_service.core import defaults as D
from hkv_service.core.defaults import DEFAULT_SEGMENT_BLOCKS, MAX_PARTITIONS

if TYPE_CHECKING:
    from hkv_service.core.api import StateConfig
    from hkv_service.core.spec import CacheSpec

__all__ = [
    "DEFAULT_PORT", "DEFAULT_SEGMENT_BLOCKS", "DEMO_WIRINGS", "MAX_PARTITIONS",
    "SYSTEM_DEFAULTS", "ClientSettings", "Credentials", "DemoSettings",
    "ServiceInputs", "ServiceSettings", "SettingsError", "SystemSettings", "TlsConfig",
    "is_loopback",
]

DEFAULT_PORT = 50051
GIVEN = "_settings_given"  # namespace attribute: the dests given on the command line

Check = Callable[[Any], "str | None"]
S = TypeVar("S", bound="_Settings")


class SettingsError(ValueError):
    """A setting that cannot work; the message is one sentence for the user."""


def setting(default: Any, help: str, check: Check | None = None, *, flag: bool = True) -> Any:
    """A settings field. ``check(value)`` returns what is wrong (``"must not be negative"``)
    or None; ``flag=False``: set from code only (no flag, no config key)."""
    return field(default=default, metadata={"help": help, "check": check, "flag": flag})


# -- checks -----------------------------------------------------------------------------------

def _port(v: int) -> str | None:
    return None if 0 <= v <= 65535 else "must be between 0 and 65535"


def _positive(v: int) -> str | None:
    return None if v >= 1 else "must be a positive integer"


def _not_negative(v: float) -> str | None:
    return None if v >= 0 else "must not be negative"


def _above_zero(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def _not_empty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def _partition(v: str) -> str | None:
    index, sep, count = v.partition("/")
    if not (sep and index.isdigit() and count.isdigit()):
        return "must be written I/N (e.g. 0/1, or 2/4: the third of four partitions)"
    if not 0 <= int(index) < int(count) <= MAX_PARTITIONS:
        return f"must have 0 <= I < N <= {MAX_PARTITIONS}"
    return None


def _event_form(v: str) -> str | None:
    return None if v in ("map", "array") else "must be map or array"


def _replicas(v: int) -> str | None:
    return None if 1 <= v <= MAX_PARTITIONS else f"must be between 1 and {MAX_PARTITIONS}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


# How a flag's text becomes a value, by the field's annotation (bool fields are switches).
_PARSE: dict[str, Callable[[str], Any]] = {
    "str": str, "str | None": str, "int": int, "int | None": int, "float": float,
    "float | None": float,
    "tuple[str, ...]": _names,
}


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (a --config file must not override
    it, even when it equals the default)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Settings:
    """What every settings class derives from its fields."""

    __slots__ = ()

    @classmethod
    def flag_fields(cls) -> Iterator[Field[Any]]:
        return (f for f in fields(cls) if f.metadata.get("flag", False))  # type: ignore[arg-type]

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        for f in cls.flag_fields():
            if f.type == "bool":
                parser.add_argument(flag_of(f.name), action=_Given, nargs=0, default=f.default,
                                    help=f.metadata["help"])
            else:
                parser.add_argument(flag_of(f.name), action=_Given, type=_PARSE[str(f.type)],
                                    default=f.default, help=f.metadata["help"])

    @classmethod
    def from_args(cls: type[S], args: argparse.Namespace, file: Mapping[str, Any] | None = None
                  ) -> S:
        """From parsed flags; ``file`` (``from_mapping``'s result) fills what no flag gave."""
        given: frozenset[str] = getattr(args, GIVEN, frozenset())
        values = dict(file or {})
        values.update({f.name: getattr(args, f.name) for f in cls.flag_fields()
                       if hasattr(args, f.name) and (f.name in given or f.name not in values)})
        return cls(**values)  # checked here (__post_init__)

    @classmethod
    def from_mapping(cls, raw: Mapping[Any, Any], source: str) -> dict[str, Any]:
        """The values of a mapping of setting names (``lookup-memo-mib`` or ``lookup_memo_mib``)
        to values, each coerced to its field's type (YAML gives ints, strings, lists)."""
        known = {f.name: f for f in cls.flag_fields()}
        out: dict[str, Any] = {}
        for key, value in raw.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise SettingsError(f"{source}: unknown key {key!r}")
            out[name] = _coerce(known[name], value, f"{source}: {key}")
        return out

    @classmethod
    def from_argv(cls: type[S], argv: list[str]) -> S:
        parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        cls.add_flags(parser)
        return cls.from_args(parser.parse_args(argv))

    def to_argv(self) -> list[str]:
        """Flags that make ``from_argv`` give this object back (every flag field)."""
        argv: list[str] = []
        for f in self.flag_fields():
            value = getattr(self, f.name)
            if value is None or value is False or value == ():
                continue
            if value is True:
                argv.append(flag_of(f.name))
            else:
                text = ",".join(value) if isinstance(value, tuple) else str(value)
                argv += [flag_of(f.name), text]
        return argv

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            check: Check | None = f.metadata.get("check")
            value = getattr(self, f.name)
            if check is not None and value is not None and (problem := check(value)):
                raise SettingsError(f"{flag_of(f.name)} {problem}, got {value!r}")
        for problem in self._rules():
            raise SettingsError(problem)

    def _rules(self) -> Iterator[str]:
        """What is wrong with the values together (each a sentence)."""
        return iter(())


def _coerce(f: Field[Any], value: Any, where: str) -> Any:
    kind = str(f.type)
    if value is None and "None" in kind:
        return None
    if kind == "bool":
        if isinstance(value, bool):
            return value
    elif kind == "tuple[str, ...]":
        if isinstance(value, str):
            return _names(value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif kind.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise SettingsError(f"{where} must be {_KIND_NAMES.get(kind, kind)}, got {value!r}")


_KIND_NAMES = {"bool": "true or false", "int": "an integer", "int | None": "an integer",
               "float": "a number", "str": "a string", "str | None": "a string",
               "tuple[str, ...]": "a list of names"}


# -- TLS material and client credentials (bytes: they cross process and node boundaries) ------

@dataclass(frozen=True, slots=True)
class TlsConfig:
    """A client's TLS: the roots it trusts and, for mTLS, its own certificate."""

    ca: bytes | None = None  # PEM roots; None: the system's
    cert: bytes | None = None  # client certificate chain (mTLS)
    key: bytes | None = None  # client private key (mTLS)
    server_name: str | None = None  # override the name checked against the certificate


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a client presents: a token (sent as ``authorization: Bearer``) and TLS."""

    token: str | None = None
    tls: TlsConfig | None = None


@dataclass(frozen=True, slots=True)
class ServiceInputs:
    """What a service's settings name on disk, read and checked once (``load``)."""

    spec: CacheSpec
    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_ca: bytes | None = None  # client certificates must chain to it (mTLS)


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError:
        raise SettingsError(f"{flag} {path} is not a readable file") from None


def _token(path: str | None, flag: str) -> str | None:
    raw = _read(path, flag)
    if raw is None:
        return None
    token = raw.decode(errors="replace").strip()
    if not token:
        raise SettingsError(f"{flag} {path} is empty")
    return token


# -- the roles ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ServiceSettings(_Settings):
    """The metadata service's settings (``hkv serve``; hkv up hands them to its service)."""

    host: str = setting("127.0.0.1", "address to bind (default 127.0.0.1); any other than "
                        "loopback needs --auth-token-file or --tls-cert/--tls-key, or "
                        "--insecure", _not_empty)
    port: int = setting(DEFAULT_PORT, f"gRPC port (0 = pick a free one; default "
                        f"{DEFAULT_PORT})", _port)
    metrics_port: int = setting(0, "Prometheus /metrics port, on --host (default 0: off)", _port)
    spec: str | None = setting(None, "cache spec YAML/JSON (default: the reference model's "
                               "spec)")
    auth_token_file: str | None = setting(None, "file holding a shared token clients must "
                                          "send (metadata 'authorization: Bearer <token>')")
    tls_cert: str | None = setting(None, "server certificate (PEM); enables TLS")
    tls_key: str | None = setting(None, "server private key (PEM)")
    tls_ca: str | None = setting(None, "CA bundle (PEM); requires client certificates that "
                                 "chain to it (mTLS)")
    tls_allowed_cn: tuple[str, ...] = setting((), "comma-separated client certificate CNs "
                                              "allowed (needs --tls-ca); others get "
                                              "PERMISSION_DENIED")
    insecure: bool = setting(False, "allow a non-loopback bind without TLS or token (logs a "
                             "warning)")
    heartbeat_timeout_s: float = setting(D.HEARTBEAT_TIMEOUT_S, "an owner silent this long "
                                         "has its objects marked lost (default "
                                         f"{D.HEARTBEAT_TIMEOUT_S:g})", _above_zero)
    grace_s: float = setting(5.0, "seconds in-flight RPCs get to finish on shutdown "
                             "(default 5)", _not_negative)
    max_inflight_objects: int = setting(D.MAX_INFLIGHT_OBJECTS, "admission cap: objects in "
                                        "transit between tiers at once (default "
                                        f"{D.MAX_INFLIGHT_OBJECTS})", _positive)
    max_inflight_bytes: int = setting(D.MAX_INFLIGHT_BYTES, "admission cap: bytes in transit "
                                      "between tiers at once (default "
                                      f"{D.MAX_INFLIGHT_BYTES >> 20} MiB)", _positive)
    max_owners: int = setting(D.MAX_OWNERS, "owners (shards) registered at once; a new one "
                              "beyond it is refused with RESOURCE_EXHAUSTED (default "
                              f"{D.MAX_OWNERS})", _positive)
    lookup_memo_mib: int = setting(D.LOOKUP_MEMO_MIB, "memory for answers to repeated long "
                                   "lookups, kept until their prefix changes (the lookup "
                                   f"memo; 0 = off; default {D.LOOKUP_MEMO_MIB})",
                                   _not_negative)
    walk_segment_blocks: int | None = setting(
        None, "blocks per walk segment: runs of this many blocks walked whole twice are taken "
        "whole by later lookups through them (a multiple of the spec's period, 2 for the "
        "reference spec; 0 = off; default: the first multiple of the period from "
        f"{DEFAULT_SEGMENT_BLOCKS})")
    partition: str = setting("0/1", "this service's metadata partition, I of N: it holds the "
                             "prompts whose root hash routes to it (hkv up "
                             "--service-replicas N sets it for each replica; default 0/1, "
                             "the whole view)", _partition)
    range_blocks: int = setting(D.RANGE_BLOCKS, "split each prompt's chain across the metadata "
                                "partitions "
                                "every this many blocks (range k lives in the partition of "
                                "its first hash), so one system prompt shared by every "
                                "request does not put every lookup's walk on one partition "
                                "(a multiple of the spec's period; every replica and client "
                                "must use the same; default 0: a chain kept whole in its "
                                "root's partition)", _not_negative)
    kv_events_port: int = setting(0, "publish KV events (vLLM's wire format: ZMQ PUB on this "
                                  "port, replay ROUTER on the next; partition I of N on port "
                                  "+2I, +2I+1) for prefix-aware routers: docs/routing.md "
                                  "(default 0: off)", _port)
    kv_events_host: str = setting("127.0.0.1", "address the KV event sockets bind (default "
                                  "127.0.0.1); any other than loopback needs --insecure (the "
                                  "stream has no auth)", _not_empty)
    kv_events_topic: str = setting("kv@hkv-p{partition}@hkv", "topic of the KV event frames; "
                                   "{partition} is this partition's index (default "
                                   "kv@hkv-p{partition}@hkv)", _not_empty)
    kv_events_form: str = setting("map", "how events are encoded: map (tagged maps, as vLLM "
                                  "0.32 and its KVEventBatch decode them) or array (tag first, "
                                  "fields by position, as llm-d reads them; default map)",
                                  _event_form)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def guarded(self) -> bool:
        """A bind anyone may reach is guarded by TLS or a token (or loopback)."""
        return is_loopback(self.host) or self.tls or self.auth_token_file is not None

    def _rules(self) -> Iterator[str]:
        if (self.tls_cert is None) != (self.tls_key is None):
            yield "--tls-cert and --tls-key must be given together"
        if self.tls_ca is not None and not self.tls:
            yield "--tls-ca (mTLS) needs --tls-cert and --tls-key as well"
        if self.tls_allowed_cn and self.tls_ca is None:
            yield "--tls-allowed-cn needs mTLS: give --tls-ca with --tls-cert/--tls-key"
        if self.kv_events_port and not is_loopback(self.kv_events_host) and not self.insecure:
            yield (f"refusing to publish KV events on non-loopback {self.kv_events_host} "
                   "without --insecure: the stream carries no auth")
        if not self.guarded and not self.insecure:
            yield (f"refusing to bind non-loopback address {self.host} without TLS or an auth "
                   "token; give --tls-cert/--tls-key or --auth-token-file, or --insecure")

    def service(self) -> ServiceSettings:
        """The service's part (itself; a SystemSettings gives its service settings)."""
        return ServiceSettings(**{f.name: getattr(self, f.name) for f in fields(ServiceSettings)})

    def load(self) -> ServiceInputs:
        """Read and check what the settings name: token, TLS files, the spec, and the walk
        segment size against the spec. Raises SettingsError with one sentence."""
        from hkv_service.core.errors import InvalidInput, SpecError
        from hkv_service.core.layout import Layout
        from hkv_service.core.partitions import check_range_blocks
        from hkv_service.core.segments import segment_blocks_for
        from hkv_service.specs import resolve_spec

        token = _token(self.auth_token_file, "--auth-token-file")
        cert, key = _read(self.tls_cert, "--tls-cert"), _read(self.tls_key, "--tls-key")
        ca = _read(self.tls_ca, "--tls-ca")
        try:
            spec = resolve_spec(self.spec)
        except SpecError as err:
            raise SettingsError(f"--spec: {err}") from None
        try:
            segment_blocks_for(Layout(spec), self.walk_segment_blocks)
        except InvalidInput as err:
            raise SettingsError(f"--walk-segment-blocks: {err}") from None
        try:
            check_range_blocks(self.range_blocks, Layout(spec).period)
        except InvalidInput as err:
            raise SettingsError(f"--range-blocks: {err}") from None
        return ServiceInputs(spec, token, cert, key, ca)

    def state_config(self) -> StateConfig:
        from hkv_service.core.api import AdmissionCap, StateConfig
        from hkv_service.core.partitions import Partition

        return StateConfig(
            admission=AdmissionCap(self.max_inflight_objects, self.max_inflight_bytes),
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            max_owners=self.max_owners,
            memo_max_bytes=self.lookup_memo_mib << 20,
            segment_blocks=self.walk_segment_blocks,
            partition=Partition.parse(self.partition),
            range_blocks=self.range_blocks,
        )


@dataclass(frozen=True, slots=True)
class SystemSettings(ServiceSettings):
    """``hkv up``: the service's settings, and those of Ray, the shards and hkv up's own
    clients (the shards and ``System.metadata()``). Those clients trust the service's own
    certificate (``--tls-cert``); under mTLS they present ``--tls-client-cert``."""

    address: str | None = setting(None, "join an existing Ray cluster ('auto' or "
                                  "ray://host:port); default starts a local Ray instance")
    data_dir: str = setting("hkv-data", "folder under which each shard keeps its LMDB disk "
                            "tier (shard-KEY-K: hkv up started again finds the tiers there "
                            "and keeps their names; default ./hkv-data)", _not_empty)
    blocks_per_group: int = setting(256, "blocks each shard allocates per cache group "
                                    "(default 256)", _positive)
    disk_budget_bytes: int = setting(1 << 30, "byte budget of each node's disk tier "
                                     "(default 1 GiB)", _positive)
    shards_per_node: int = setting(1, "shard actors per node (default 1)", _positive)
    service_restarts: int = setting(5, "restarts of a metadata service that exited that hkv "
                                    "up makes within --restart-window-s; one more death "
                                    "within it (a crash loop) stops hkv up with exit 1 "
                                    "(default 5)", _positive)
    shard_replacements: int = setting(5, "new actors hkv up places for one shard that died "
                                      "for good (its Ray restarts used up) within "
                                      "--restart-window-s; past them its node goes without "
                                      "that shard until the window has room (default 5)",
                                      _positive)
    restart_window_s: float = setting(600.0, "the time window of --service-restarts and "
                                      "--shard-replacements, in seconds: deaths further apart "
                                      "are restarted however many there are (default 600)",
                                      _above_zero)
    service_replicas: int = setting(1, "metadata partitions, each its own service (a `hkv "
                                    "serve` process, or a Ray actor with --address) on "
                                    "consecutive ports from --port (and --metrics-port); a "
                                    "prompt's metadata lives in the partition of its root "
                                    "hash, so lookups and writes spread (default 1)",
                                    _replicas)
    tls_client_cert: str | None = setting(None, "certificate (PEM) the shards and hkv up's "
                                          "own client present under mTLS (--tls-ca)")
    tls_client_key: str | None = setting(None, "private key (PEM) of --tls-client-cert")
    tls_server_name: str | None = setting(None, "name hkv up's own clients check the service "
                                          "certificate against (default: the endpoint's "
                                          "host)")
    num_cpus: int | None = setting(None, "CPUs of a local Ray instance", flag=False)
    max_restarts: int = setting(1, "restarts of a crashed shard actor", flag=False)
    device: str = setting("auto", "torch device of the shards' pools", flag=False)
    start_timeout_s: float = setting(60.0, "how long each part may take to start",
                                     _above_zero, flag=False)

    def _rules(self) -> Iterator[str]:
        yield from ServiceSettings._rules(self)
        if self.partition != "0/1":
            yield ("--partition is one replica's own: hkv up sets it for each; give "
                   "--service-replicas N")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            yield "--tls-client-cert and --tls-client-key must be given together"
        if self.tls_ca is not None and self.tls_client_cert is None:
            yield ("--tls-ca (mTLS) makes the service ask every client for a certificate: "
                   "give --tls-client-cert/--tls-client-key for the shards and hkv up's client")
        if self.tls_client_cert is not None and self.tls_ca is None:
            yield "--tls-client-cert/--tls-client-key need --tls-ca (mTLS)"
        if self.tls_server_name is not None and not self.tls:
            yield "--tls-server-name needs --tls-cert/--tls-key"

    def credentials(self, inputs: ServiceInputs) -> Credentials:
        """What hkv up's own clients present: the token, and TLS trusting the service's own
        certificate (with the client certificate under mTLS)."""
        tls = None
        if inputs.tls_cert is not None:
            tls = TlsConfig(inputs.tls_cert, _read(self.tls_client_cert, "--tls-client-cert"),
                            _read(self.tls_client_key, "--tls-client-key"), self.tls_server_name)
        return Credentials(inputs.token, tls)


SYSTEM_DEFAULTS = SystemSettings()
"""Every setting of hkv up at its default: what a part built from code with no settings takes
(``workers.shard.ShardConfig``, ``workers.inprocess.InProcessConfig``)."""


def _wiring(v: str) -> str | None:
    return None if v in DEMO_WIRINGS else f"must be one of {', '.join(DEMO_WIRINGS)}"


DEMO_WIRINGS = ("system", "inprocess")


@dataclass(frozen=True, slots=True)
class DemoSettings(_Settings):
    """``hkv demo``: the reference-model workload, its faults and the wiring it runs on."""

    requests: int = setting(48, "requests to run (default 48)", _positive)
    duration: float | None = setting(None, "stop after this many seconds")
    seed: int = setting(0, "fixes workload and faults")
    faults: str = setting("none", "'none', 'all', or a comma list of fault names (name or "
                          "name=rate)")
    check: bool = setting(False, "compare every output with a full recompute; exit 1 on any "
                          "mismatch")
    workers: int = setting(2, "concurrent inference workers", _positive)
    service_replicas: int = setting(1, "metadata partitions the demo's system runs (default 1)",
                                    _replicas)
    range_blocks: int = setting(D.RANGE_BLOCKS, "split each prompt's chain across the "
                                "partitions every this many blocks (a multiple of the spec's "
                                "period, 2; default 0: a chain kept whole)", _not_negative)
    backend: str | None = setting(None, "the wiring: 'system' (what hkv up starts, through "
                                  "gRPC and Ray) or 'inprocess' (the same real parts in this "
                                  "process); default: the system, in-process with a note "
                                  "when it cannot start", _wiring)
    json: bool = setting(False, "print one JSON object")


@dataclass(frozen=True, slots=True)
class ClientSettings(_Settings):
    """A client's token and TLS (``hkv stats``)."""

    auth_token_file: str | None = setting(None, "token file, if the service wants one")
    tls: bool = setting(False, "use TLS, trusting the system's roots (implied by the --tls-* "
                        "flags below)")
    tls_ca: str | None = setting(None, "CA bundle (PEM) that the service's certificate must "
                                 "chain to; enables TLS")
    tls_cert: str | None = setting(None, "client certificate (PEM), for a service with mTLS")
    tls_key: str | None = setting(None, "client private key (PEM)")
    tls_server_name: str | None = setting(None, "name to check the service's certificate "
                                          "against (default: the endpoint's host)")

    def _rules(self) -> Iterator[str]:
        if (self.tls_cert is None) != (self.tls_key is None):
            yield "--tls-cert and --tls-key must be given together"

    def load(self) -> Credentials:
        token = _token(self.auth_token_file, "--auth-token-file")
        wants_tls = self.tls or any(v is not None for v in (self.tls_ca, self.tls_cert,
                                                             self.tls_server_name))
        if not wants_tls:
            return Credentials(token)
        return Credentials(token, TlsConfig(_read(self.tls_ca, "--tls-ca"),
                                            _read(self.tls_cert, "--tls-cert"),
                                            _read(self.tls_key, "--tls-key"),
                                            self.tls_server_name))
