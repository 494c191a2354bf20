"""Checks a request must pass before it may touch the state view.

The core validates its own inputs; these checks exist where a core method would mutate
something before discovering the request is bad (so a rejected request would not leave the
state unchanged), or where input is outside what the core can represent (a pool of 2**60
blocks). Every failure is a core :class:`InvalidInput` / :class:`UnknownOwner`, so the one
status table maps it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hkv_service.core.api import LookupRequest, PoolConfig
from hkv_service.core.errors import BadHash, InvalidInput, UnknownGroup, UnknownOwner
from hkv_service.core.funnel import validate_request
from hkv_service.core.ids import BLOCK_HASH_BYTES, ShardId
from hkv_service.core.inputs import check_pool, lease_ttl_exceeded
from hkv_service.core.state_view import CacheState

__all__ = [
    "check_columns",
    "check_hashes",
    "check_lookups",
    "check_owner",
    "check_pools",
]


def check_owner(state: CacheState, owner: str, where: str) -> ShardId:
    if not owner:
        raise InvalidInput(f"{where}: owner id must be a non-empty string")
    if not state.has_owner(owner):
        raise UnknownOwner(f"owner {owner!r} is not registered")
    return ShardId(owner)


def check_columns(state: CacheState, names: Iterable[str], where: str) -> None:
    known = state.layout.by_name
    for name in names:
        if name not in known:
            raise UnknownGroup(f"{where}: unknown group {name!r}; the spec has {sorted(known)}")


def check_pools(state: CacheState, pools: Mapping[str, PoolConfig]) -> None:
    check_columns(state, pools, "RegisterOwner")
    for name, cfg in pools.items():
        check_pool(name, cfg)  # the core's bounds (core/inputs.py), before any is taken


def check_hashes(hashes: Sequence[bytes], where: str) -> None:
    if not hashes:
        raise BadHash(f"{where}: no block hashes given; a prefix needs at least one")
    for i, h in enumerate(hashes):
        if len(h) != BLOCK_HASH_BYTES:
            raise BadHash(f"{where}: block hash {i} must be {BLOCK_HASH_BYTES} bytes, "
                          f"got {len(h)}")


def check_lookups(state: CacheState, requests: Sequence[LookupRequest]) -> None:
    """Validate a whole batch first, so a bad item rejects it before any lease is taken."""
    max_ttl = state.config.max_lease_ttl_s
    for i, req in enumerate(requests):
        try:
            validate_request(req, state.layout)
        except InvalidInput as err:
            raise type(err)(f"lookup {i}: {err}") from None
        if req.lease_ttl_s > max_ttl:
            raise lease_ttl_exceeded(req.lease_ttl_s, max_ttl, f"lookup {i}: ")
        try:
            state.check_placed(req)
        except InvalidInput as err:
            raise type(err)(f"lookup {i}: {err}") from None
