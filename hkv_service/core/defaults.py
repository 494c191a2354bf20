"""The metadata service's tunables, each default written once.

``settings.py`` puts a flag, a help text and a check on each (``ServiceSettings``: what ``hkv
serve`` and ``hkv up`` take); the core's own configs (``api.StateConfig``,
``admission.AdmissionCap``) and the limits they check take them as their defaults. This
module imports nothing, so importing it costs nothing (``hkv --help`` imports settings).
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_SEGMENT_BLOCKS",
    "HEARTBEAT_TIMEOUT_S",
    "LOOKUP_MEMO_MIB",
    "MAX_INFLIGHT_BYTES",
    "MAX_INFLIGHT_OBJECTS",
    "MAX_OWNERS",
    "MAX_PARTITIONS",
    "RANGE_BLOCKS",
]

HEARTBEAT_TIMEOUT_S = 10.0  # an owner silent this long is declared lost
MAX_INFLIGHT_OBJECTS = 64  # admission cap: objects in transit between tiers at once
MAX_INFLIGHT_BYTES = 256 << 20  # admission cap: bytes in transit between tiers at once
MAX_OWNERS = 1024  # owners (shards) registered at once
LOOKUP_MEMO_MIB = 64  # the lookup memo's bytes (core/memo.py), in MiB
DEFAULT_SEGMENT_BLOCKS = 64  # walk segments: the size, before rounding to the layout's period
MAX_PARTITIONS = 64  # metadata partitions of one deployment (core/partitions.py)
RANGE_BLOCKS = 0  # chains split across partitions every this many blocks (0: kept whole)
