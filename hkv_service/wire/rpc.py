"""The client's error for a call that failed with no domain meaning: its own module, with no
grpc import, so a worker can tell an outage from a refusal without loading the client (the
workers import neither the server nor the client)."""

from __future__ import annotations

from hkv_service.core.errors import HkvError

__all__ = ["RpcFailed"]


class RpcFailed(HkvError):
    """A gRPC failure with no domain meaning; ``code`` is the status code's name
    (DEADLINE_EXCEEDED, UNAUTHENTICATED ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
