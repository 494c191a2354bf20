"""Errors of the vLLM connector: a vLLM setup hkv cannot serve, said in one sentence.

::

    ConnectorError                    (an HkvError: InvalidInput)
    ├── UnsupportedKVCache            a KV-cache group hkv cannot represent (carries the group)
    ├── BadConnectorConfig            a kv_connector_extra_config key is wrong (carries the key)
    └── SpecMismatch                  the hkv service runs another cache spec than vLLM needs

Each is raised when vLLM builds the connector, before any request is served: a connector that
cannot keep hkv's promise (a hit is only what the funnel certifies) does not start.
"""

from __future__ import annotations

from hkv_service.core.errors import InvalidInput

__all__ = ["BadConnectorConfig", "ConnectorError", "SpecMismatch", "UnsupportedKVCache"]


class ConnectorError(InvalidInput):
    """vLLM was configured in a way the hkv connector cannot serve."""


class UnsupportedKVCache(ConnectorError):
    def __init__(self, group: int, spec_type: str, why: str) -> None:
        super().__init__(f"KV-cache group {group} ({spec_type}): {why}")
        self.group = group
        self.spec_type = spec_type
        self.why = why


class BadConnectorConfig(ConnectorError):
    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"kv_connector_extra_config[{key!r}]: {why}")
        self.key = key
        self.why = why


class SpecMismatch(ConnectorError):
    def __init__(self, service_model_id: str, wanted_model_id: str, spec_path: str | None) -> None:
        where = f"; the spec vLLM needs is in {spec_path}" if spec_path else ""
        super().__init__(
            f"the hkv service runs cache spec {service_model_id!r}, not the one this vLLM "
            f"engine needs ({wanted_model_id!r}): start it with --spec <that spec>{where}"
        )
        self.service_model_id = service_model_id
        self.wanted_model_id = wanted_model_id
        self.spec_path = spec_path
