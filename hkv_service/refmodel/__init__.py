"""The reference model: a tiny seeded hybrid-attention model, the project's correctness oracle.

Generation from cached state (blocks and tails exported, stored, imported) must give the same
logits as a full recompute; any cache object that is wrong, stale or zeroed changes them. See
:mod:`.model` for the architecture and the chunking that makes resumes bit-equal,
:mod:`.compress` for the compressors' index ranges and :mod:`.blocks` for the block layout.
Torch lives here, at the edge; :mod:`hkv_service.core` never imports it.
"""

from __future__ import annotations

from .blocks import BlockRun
from .cache import CompressedState, ModelCache
from .config import Geometry, RefModelConfig
from .model import LOGITS_ATOL, LOGITS_RTOL, RefModel

__all__ = [
    "LOGITS_ATOL",
    "LOGITS_RTOL",
    "BlockRun",
    "CompressedState",
    "Geometry",
    "ModelCache",
    "RefModel",
    "RefModelConfig",
]
