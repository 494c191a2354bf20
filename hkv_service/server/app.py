"""Assemble the gRPC server: servicer, health, reflection, auth, TLS, message limits.

:func:`create_server` binds and starts, returning ``(server, port)`` so tests can bind
``127.0.0.1:0`` in-process; :func:`build_service` returns the parts a launcher needs too
(health servicer, the stop signal for streaming RPCs). ``serve.py`` adds the process concerns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hkv_service.core.state_view import CacheState
from hkv_service.proto_gen.hkv.v1 import hkv_pb2, hkv_pb2_grpc
from hkv_service.specs import default_spec
from hkv_service.wire import codec

from .auth import (
    DEFAULT_EXEMPT,
    CommonNameInterceptor,
    TlsFiles,
    TlsPem,
    TokenInterceptor,
    server_credentials,
)
from .servicer import MetadataServicer
from .tokenbook import TokenBook

__all__ = ["SERVICE_NAME", "ServerConfig", "Service", "build_service", "create_server"]

SERVICE_NAME = hkv_pb2.DESCRIPTOR.services_by_name["MetadataService"].full_name
MAX_RECEIVE_BYTES = 64 << 20
MAX_SEND_BYTES = 64 << 20
Parse = Callable[[Any, str, bytes, grpc.ServicerContext], Any]  # MetadataServicer.parse


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    max_workers: int = 16
    auth_token: str | None = None
    tls: TlsFiles | TlsPem | None = None
    auth_exempt: tuple[str, ...] = DEFAULT_EXEMPT
    allowed_cns: tuple[str, ...] = ()  # mTLS: client certificate CNs allowed (empty: any)
    max_receive_bytes: int = MAX_RECEIVE_BYTES


@dataclass(slots=True)
class Service:
    server: grpc.Server
    port: int
    state: CacheState
    health: health.HealthServicer
    stopping: threading.Event = field(default_factory=threading.Event)

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def stop(self, grace: float | None) -> threading.Event:
        """Health NOT_SERVING first, then end streams and stop (in-flight RPCs get ``grace``)."""
        self.set_serving(False)
        self.stopping.set()
        done: threading.Event = self.server.stop(grace)
        return done


class _Capture:
    """Stands in for a server so the generated registration hands us its handler table."""

    handlers: dict[str, grpc.RpcMethodHandler]

    def add_generic_rpc_handlers(self, _handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, _name: str,
                                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = handlers


def _add_servicer(servicer: MetadataServicer, server: grpc.Server) -> None:
    """The generated handlers, except that LookupStream receives raw bytes and decodes them
    itself: grpcio 1.85 leaves a request-streaming call whose message fails to deserialize
    half-finished, and ``server.stop()`` then never completes (found by the fuzz test)."""
    capture = _Capture()
    hkv_pb2_grpc.add_MetadataServiceServicer_to_server(  # type: ignore[no-untyped-call]
        servicer, capture)
    handlers = {name: _decoding(name, h, servicer.parse) for name, h in capture.handlers.items()}
    # Lookup takes the request's bytes and answers bytes (servicer.py says why).
    handlers["Lookup"] = grpc.unary_unary_rpc_method_handler(
        servicer.LookupRaw, response_serializer=_as_is)
    handlers["LookupStream"] = grpc.stream_stream_rpc_method_handler(
        servicer.LookupStreamRaw, response_serializer=_as_is)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _decoding(method: str, handler: grpc.RpcMethodHandler, parse: Parse
              ) -> grpc.RpcMethodHandler:
    """``handler`` taking the request's bytes and parsing them with ``parse``
    (``MetadataServicer.parse``: INVALID_ARGUMENT, counted, for bytes that are not its
    message). Request-streaming handlers are replaced whole (see above)."""
    decode = handler.request_deserializer
    message = getattr(decode, "__self__", None)  # the generated Message.FromString
    if message is None or handler.request_streaming:
        return handler
    if handler.unary_unary is not None:
        unary = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda raw, ctx: unary(parse(message, method, raw, ctx), ctx),
            response_serializer=handler.response_serializer)
    assert handler.unary_stream is not None
    stream = handler.unary_stream
    return grpc.unary_stream_rpc_method_handler(
        lambda raw, ctx: stream(parse(message, method, raw, ctx), ctx),
        response_serializer=handler.response_serializer)


def _as_is(reply: bytes) -> bytes:
    return reply


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def build_service(config: ServerConfig, state: CacheState | None = None,
                  tokens: TokenBook | None = None) -> Service:
    """``tokens``: where Allocate's token ids go for the KV event stream (None: dropped)."""
    state = state if state is not None else CacheState(default_spec())
    interceptors: list[grpc.ServerInterceptor] = (
        [TokenInterceptor(config.auth_token, config.auth_exempt)] if config.auth_token else [])
    if config.allowed_cns:
        interceptors.append(CommonNameInterceptor(config.allowed_cns, config.auth_exempt))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                   thread_name_prefix="hkv-rpc"),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", config.max_receive_bytes),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    stopping = threading.Event()
    codec.install_encoder(state)
    _add_servicer(MetadataServicer(state, stopping, tokens), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = _address(config.host, config.port)
    if config.tls is not None:
        port = server.add_secure_port(address, server_credentials(config.tls))
    else:
        port = server.add_insecure_port(address)
    service = Service(server, port, state, health_servicer, stopping)
    service.set_serving(True)
    return service


def create_server(config: ServerConfig, state: CacheState | None = None) -> tuple[grpc.Server, int]:
    """Bind ``config.host:config.port`` and start; returns the server and the bound port."""
    service = build_service(config, state)
    service.server.start()
    return service.server, service.port
