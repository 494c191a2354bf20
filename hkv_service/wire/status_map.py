"""The ONE table from hkv's error tree to gRPC status codes (and back, for the client).

::

    core error (MRO walked, first hit wins)   grpc.StatusCode       extra trailing metadata
    InvalidInput (BadHash, UnknownGroup, ...)  INVALID_ARGUMENT
    NotFound (UnknownObject, UnknownLease ...) NOT_FOUND
    StaleHandle                                FAILED_PRECONDITION   message "stale, recompute: ..."
    FailedPrecondition (IllegalTransition ...) FAILED_PRECONDITION
    AdmissionRefused                           RESOURCE_EXHAUSTED    retry-after-ms
    ResourceExhausted (PoolExhausted)          RESOURCE_EXHAUSTED
    Unavailable (OwnerLost)                    UNAVAILABLE
    HkvError (anything else of ours)           INTERNAL

Every error also carries ``hkv-error: <class name>`` so the client re-raises the same class.
Errors grafted onto the tree elsewhere map by their core ancestor: the disk tier's
(``storage/errors.py``) NotOnDisk and CorruptEntry -> NOT_FOUND, DiskFull ->
RESOURCE_EXHAUSTED, StorageFailure -> UNAVAILABLE; the client, which does not import
``storage``, raises the core class of that code (an ancestor of the server's class).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from hkv_service.core import errors as E

__all__ = [
    "CODE_TO_ERROR",
    "ERROR_CLASS_KEY",
    "RETRY_AFTER_KEY",
    "STATUS_TABLE",
    "MappedError",
    "error_class",
    "map_error",
]

ERROR_CLASS_KEY = "hkv-error"
RETRY_AFTER_KEY = "retry-after-ms"
STALE_PREFIX = "stale, recompute: "

STATUS_TABLE: dict[type[E.HkvError], grpc.StatusCode] = {
    E.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    E.NotFound: grpc.StatusCode.NOT_FOUND,
    E.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    E.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    E.Unavailable: grpc.StatusCode.UNAVAILABLE,
    E.HkvError: grpc.StatusCode.INTERNAL,
}

# The client's fallback when a status carries no (known) hkv-error class.
CODE_TO_ERROR: dict[grpc.StatusCode, type[E.HkvError]] = {
    code: cls for cls, code in STATUS_TABLE.items() if cls is not E.HkvError
}


@dataclass(frozen=True, slots=True)
class MappedError:
    code: grpc.StatusCode
    message: str
    error_class: str
    retry_after_ms: int | None = None

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        md = [(ERROR_CLASS_KEY, self.error_class)]
        if self.retry_after_ms is not None:
            md.append((RETRY_AFTER_KEY, str(self.retry_after_ms)))
        return tuple(md)


def map_error(err: E.HkvError) -> MappedError:
    code = next(STATUS_TABLE[c] for c in type(err).__mro__ if c in STATUS_TABLE)
    message = str(err)
    if isinstance(err, E.StaleHandle) and not message.startswith(STALE_PREFIX):
        message = STALE_PREFIX + message
    retry = None
    if isinstance(err, E.AdmissionRefused):
        retry = max(1, round(err.retry_after_s * 1000))
    return MappedError(code, message, type(err).__name__, retry)


def error_class(name: str | None, code: grpc.StatusCode | None) -> type[E.HkvError] | None:
    """The domain class a client should raise: by name if it is ours, else by status code."""
    cls = getattr(E, name, None) if name else None
    if isinstance(cls, type) and issubclass(cls, E.HkvError):
        return cls
    return CODE_TO_ERROR.get(code) if code is not None else None
