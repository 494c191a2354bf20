"""Transport security: an optional shared bearer token, TLS and mTLS.

The token interceptor compares ``authorization: Bearer <token>`` in constant time
(:func:`hmac.compare_digest`) and answers UNAUTHENTICATED otherwise. It never logs or echoes
the token. Health checks and reflection are exempt by default so probes and tooling work
without it (``exempt`` configures the method prefixes).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = [
    "DEFAULT_EXEMPT", "CommonNameInterceptor", "TlsFiles", "TlsPem", "TokenInterceptor",
    "server_credentials",
]

DEFAULT_EXEMPT: tuple[str, ...] = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


@dataclass(frozen=True, slots=True)
class TlsPem:
    """A server's certificate and key, and the CA its clients' certificates must chain to."""

    cert: bytes
    key: bytes
    ca: bytes | None = None  # given: client certificates are required (mTLS)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path | None = None  # given: client certificates are required (mTLS)

    def read(self) -> TlsPem:
        return TlsPem(self.cert.read_bytes(), self.key.read_bytes(),
                      self.ca.read_bytes() if self.ca is not None else None)


def server_credentials(tls: TlsFiles | TlsPem) -> grpc.ServerCredentials:
    pem = tls.read() if isinstance(tls, TlsFiles) else tls
    return grpc.ssl_server_credentials(
        [(pem.key, pem.cert)],
        root_certificates=pem.ca,
        require_client_auth=pem.ca is not None,
    )


def _denied(
    details: str, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED
) -> Callable[[Any, grpc.ServicerContext], Any]:
    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)
    return deny


def _deny_like(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """An aborting handler of the same streaming shape as ``handler``."""
    deny = _denied(details)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, token: str, exempt: Sequence[str] = DEFAULT_EXEMPT) -> None:
        if not token:
            raise ValueError("an auth token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._exempt = tuple(exempt)

    def _allowed(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        got = next((v for k, v in metadata or () if k == "authorization"), None)
        if got is None:
            return False
        value = got.encode() if isinstance(got, str) else got
        return hmac.compare_digest(value, self._expected)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(self._exempt):
            return handler
        if self._allowed(handler_call_details.invocation_metadata):
            return handler
        return _deny_like(handler, "missing or wrong auth token: send metadata "
                                   "'authorization: Bearer <token>'")


class CommonNameInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """mTLS authorisation: only clients whose certificate CN is in ``allowed`` get through;
    others get PERMISSION_DENIED. The CN is only known per call (``auth_context``), so the
    handler is wrapped rather than replaced."""

    def __init__(self, allowed: Sequence[str], exempt: Sequence[str] = DEFAULT_EXEMPT) -> None:
        if not allowed:
            raise ValueError("an allowed-CN list must not be empty")
        self._allowed = frozenset(allowed)
        self._exempt = tuple(exempt)

    def _check(self, context: grpc.ServicerContext) -> None:
        names = context.auth_context().get("x509_common_name", [])
        if not any(n.decode(errors="replace") in self._allowed for n in names):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "client certificate CN is not allowed to use this service")

    def _guard(self, behaviour: Callable[..., Any], streaming_response: bool) -> Callable[..., Any]:
        if streaming_response:
            def stream(request: Any, context: grpc.ServicerContext) -> Any:
                self._check(context)
                yield from behaviour(request, context)
            return stream

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            self._check(context)
            return behaviour(request, context)
        return unary

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        kinds = {
            (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
            (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
            (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
            (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
        }
        attr, make = kinds[(handler.request_streaming, handler.response_streaming)]
        wrapped = self._guard(getattr(handler, attr), handler.response_streaming)
        return make(wrapped, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
