"""Every adapter of the metadata port (``hkv_service.core.port.MetadataPort``) answers each of
its methods with the port's signature: the same parameters in the same order, of the same
kind, with the same defaults, and the same return type. An adapter may take a wider type
for a parameter (the gRPC client takes a plain ``int`` where the port says ``ObjectId``),
never another name, order or default (past the port's parameters it may take optional ones
of its own): a caller written against the port works on every one.
``CacheState`` answers it too, but for ``get_spec`` (it has ``spec``): the in-process view is
wrapped by ``LocalMetadata``, which runs the reaper's slices no thread runs there."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest

from hkv_service.client import MetadataClient
from hkv_service.core.port import PORT_METHODS, MetadataPort
from hkv_service.core.state_view import CacheState
from workers.local import LocalMetadata
from workers.partitioned import PartitionedMetadata
from workers.raylink import ActorMetadata

ADAPTERS: list[type[Any]] = [LocalMetadata, ActorMetadata, PartitionedMetadata, MetadataClient,
                             CacheState]
NOT_ON_CACHE_STATE = {"get_spec"}


RAY_TRACING = "_ray_trace_ctx"  # a keyword Ray's actor tracing adds to an actor class's methods


def _shape(fn: Any) -> tuple[list[tuple[str, Any, Any]], Any]:
    params = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
              if p.name != RAY_TRACING]
    # the return type as a type (``api.Match`` is ``Match``), from the annotations themselves
    # (Ray's tracing replaces an actor class's signatures, not its annotations)
    return params, typing.get_type_hints(fn).get("return")


def test_the_port_has_its_sixteen_methods() -> None:
    assert len(PORT_METHODS) == 16
    assert PORT_METHODS[0] == "get_spec" and "lookup" in PORT_METHODS


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.__name__)
@pytest.mark.parametrize("method", PORT_METHODS)
def test_every_adapter_has_the_ports_signature(adapter: type[Any], method: str) -> None:
    if adapter is CacheState and method in NOT_ON_CACHE_STATE:
        assert not hasattr(adapter, method)
        return
    (params, returns), (port_params, port_returns) = (
        _shape(getattr(adapter, method)), _shape(getattr(MetadataPort, method)))
    # the port's parameters exactly; past them only optional ones (an adapter's extension)
    extra = params[len(port_params):]
    assert (params[: len(port_params)], returns) == (port_params, port_returns) and all(
        default is not inspect.Parameter.empty for _, _, default in extra), (
        f"{adapter.__name__}.{method}{inspect.signature(getattr(adapter, method))} is not "
        f"the port's {method}{inspect.signature(getattr(MetadataPort, method))}")


def test_every_method_of_the_port_says_what_it_does() -> None:
    for method in PORT_METHODS:
        doc = inspect.getdoc(getattr(MetadataPort, method)) or ""
        assert len(doc) > 40, f"MetadataPort.{method} has no docstring worth the name"
