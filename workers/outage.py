"""A metadata-service outage, seen by an inference worker: a recompute with a reason, never a
crash.

While the service restarts, cannot be reached or does not answer within a call's deadline,
nothing can be certified. A worker's lookup then answers "reuse nothing" with the downgrade
reason :data:`OUTAGE_REASON` (:func:`lookup`), the same answer a lookup gives whenever the
funnel cannot vouch for a prefix; the worker computes the prompt and carries on, and its next
call goes through once the service is back (the gRPC channel reconnects by itself). The rest
of a worker's path already degrades without this module: ``DataPlane.read`` reads memory copies
from the shards (it only releases the lease at the service, quietly) and a disk load refused
for want of the service is a ``Recompute``; ``DataPlane.write_prefix`` reports every item of a
failed allocate or commit in ``WriteReport.failed`` (a future miss).

What counts as an outage (:func:`is_outage`), as ``MetadataClient`` maps gRPC failures::

    UNAVAILABLE        connection refused or reset, server going away   -> Unavailable
    DEADLINE_EXCEEDED  no answer within timeout_s                        -> RpcFailed(code=...)

Anything else (a malformed request, a refusal) is a real answer or the caller's bug, and is
raised. A lookup holding a lease is not retried by the client (a retry could leave a second
lease behind), so an outage reaches the worker on its first failed attempt; one without a
lease is retried for about a second first.

Used by ``workers.attach.Worker`` and the demo's backend. The vLLM connector catches every
exception of its calls on purpose (inside vLLM any failure must become a recompute), so it
needs no classification to stay up.
"""

from __future__ import annotations

import logging
from typing import Final

from hkv_service.core.api import Downgrade, LookupRequest, Match
from hkv_service.core.errors import HkvError, OwnerLost, Unavailable
from hkv_service.core.port import MetadataPort
from hkv_service.core.states import Reason
from hkv_service.wire.rpc import RpcFailed

__all__ = ["OUTAGE_REASON", "is_outage", "lookup", "outage_match"]

log = logging.getLogger(__name__)

# The metadata service did not answer (restarting, down): a reason of its own, so the
# fallbacks tell a service outage from a shard loss.
OUTAGE_REASON: Final = Reason.SERVICE_UNAVAILABLE
_OUTAGE_CODES = frozenset({"DEADLINE_EXCEEDED"})  # UNAVAILABLE arrives as Unavailable itself


def is_outage(exc: BaseException) -> bool:
    """``exc`` says the metadata service did not answer (rather than answered no)."""
    if isinstance(exc, RpcFailed):
        return exc.code in _OUTAGE_CODES
    # OwnerLost is an answer (a shard is gone), not the service's absence
    return isinstance(exc, Unavailable) and not isinstance(exc, OwnerLost)


def outage_match() -> Match:
    """A lookup's answer while the service is out: reuse nothing, and why."""
    return Match(0, 0, (Downgrade(OUTAGE_REASON, None, 0),))


def lookup(meta: MetadataPort, req: LookupRequest) -> Match:
    """``meta.lookup(req)``; during an outage :func:`outage_match` (no lease is held)."""
    try:
        return meta.lookup(req)
    except HkvError as exc:
        if not is_outage(exc):
            raise
        log.warning("hkv metadata service unavailable (%s): recomputing", exc)
        return outage_match()
