"""Payload codec: raw or zstd, and the policy that picks one.

Policy: zstd only when it pays. KV bytes are mostly high-entropy (random-normal fp16 saves
~8% at zstd level 1, fp32 ~7.5%), and decompressing entropy-coded data runs at <1 GB/s
against >10 GB/s for a plain copy, so a record is stored compressed only when that saves at
least :data:`MIN_SAVING` of its bytes. To keep incompressible payloads cheap, large ones are
judged on a :data:`PROBE_BYTES` sample from their middle first; only a promising sample pays
for compressing the whole, and the whole frame decides. Measured on the 2-core dev machine
(zstd level 1, random-normal fp16): an 8 KiB sample costs ~30 us and reads 0.924-0.931,
a 32 KiB one ~80 us and 0.919-0.922, against ~260 us for a whole 256 KiB synced put: the
32 KiB probe alone was ~30% of that put. A small sample reads a little worse than the whole
(framing, cold tables), so the sample passes with :data:`PROBE_SLACK` of margin. A stream of
payloads that keeps failing (a group's fp16 KV: its sample, or its whole frame when the sample
flattered it, or a small payload compressed whole) is then tried only once in ``SKIP_FOR + 1``
payloads (:class:`ProbeStreak`).

No zstd frame checksum is written: the record's xxh3-128 of the *raw* bytes (verified after
every decompression) is what catches a flipped bit, which zstd alone would decode silently.
Compressor objects are not thread-safe, so each thread keeps its own.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import numpy as np
import zstandard

from hkv_service.core.errors import InvalidInput

__all__ = [
    "MIN_SAVING", "PROBE_BYTES", "Codec", "ProbeStreak", "as_byte_view", "compress",
    "decompress",
]

MIN_SAVING = 0.10  # keep zstd only if stored <= 90% of raw
PROBE_BYTES = 8 * 1024
PROBE_SLACK = 0.02  # a sample passes at stored <= (1 - MIN_SAVING + PROBE_SLACK) * raw
SMALL_BYTES = 4 * 1024  # below this, framing overhead eats any saving: always raw
SKIP_AFTER = 8  # failed samples in a row before a stream's payloads go unsampled ...
SKIP_FOR = 63  # ... for this many; then one sample in 64 while it keeps failing
ZSTD_LEVEL = 1
_FHD_UNUSED_RESERVED = 0x18  # frame header descriptor (byte 4) bits 4 and 3, RFC 8878 3.1.1.1.1

_local = threading.local()


class Codec(enum.IntEnum):
    RAW = 0
    ZSTD = 1


def as_byte_view(payload: Any) -> memoryview:
    """A flat, read-only byte view of bytes, a buffer or a numpy array, without copying."""
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise InvalidInput("payload array must be C-contiguous; pass np.ascontiguousarray(x)")
        payload = payload.reshape(-1).view(np.uint8)
    try:
        view = memoryview(payload)
    except TypeError as exc:
        raise InvalidInput(f"payload must be bytes-like, not {type(payload).__name__}") from exc
    if not view.c_contiguous:
        raise InvalidInput("payload buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _compressor() -> zstandard.ZstdCompressor:
    comp = getattr(_local, "comp", None)
    if comp is None:
        comp = _local.comp = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "dec", None)
    if dec is None:
        dec = _local.dec = zstandard.ZstdDecompressor()
    return dec


def _pays(raw_len: int, stored_len: int, slack: float = 0.0) -> bool:
    return stored_len <= raw_len * (1.0 - MIN_SAVING + slack)


def compress(view: memoryview, streak: ProbeStreak | None = None
             ) -> tuple[Codec, memoryview | bytes]:
    """Return (codec, stored bytes): zstd frame if it saves >= MIN_SAVING, else the view.
    ``streak``: the history of the stream ``view`` belongs to (see :class:`ProbeStreak`)."""
    n = len(view)
    if n < SMALL_BYTES or (streak is not None and streak.skip()):
        return Codec.RAW, view
    pays = False
    try:
        if n > 2 * PROBE_BYTES:
            mid = (n - PROBE_BYTES) // 2
            sample = _compressor().compress(view[mid : mid + PROBE_BYTES])
            if not _pays(PROBE_BYTES, len(sample), PROBE_SLACK):
                return Codec.RAW, view
        frame = _compressor().compress(view)
        pays = _pays(n, len(frame))
        return (Codec.ZSTD, frame) if pays else (Codec.RAW, view)
    finally:
        if streak is not None:
            streak.record(pays)  # the verdict on the payload, not on its sample


class ProbeStreak:
    """When to stop trying to compress a stream of payloads that never compresses.

    One per stream of like payloads (a disk tier keeps one per group and kind): fp16/bf16 KV
    of one group is as incompressible in the next block as in the last. After
    :data:`SKIP_AFTER` payloads in a row stored raw for want of saving, the next
    :data:`SKIP_FOR` are stored raw untried (the sample's or the frame's cost is saved on
    each); then one try decides: another failure skips the next SKIP_FOR again, a payload
    that compresses starts over. So a stream that starts to compress is noticed within
    SKIP_FOR + 1 payloads, and an incompressible one pays for one try in SKIP_FOR + 1.
    Storing raw is always correct; only the saving can be missed. Races between writer
    threads only shift a count.
    """

    __slots__ = ("_failed", "_skipping")

    def __init__(self) -> None:
        self._failed = 0  # failed tries in a row (SKIP_AFTER or more: known incompressible)
        self._skipping = 0

    def skip(self) -> bool:
        if self._skipping:
            self._skipping -= 1
            return True
        return False

    def record(self, paid: bool) -> None:
        if paid:
            self._failed = 0
            return
        self._failed += 1
        if self._failed >= SKIP_AFTER:
            self._skipping = SKIP_FOR


def decompress(frame: memoryview, raw_len: int) -> bytes:
    """Decode one frame; raises ``zstandard.ZstdError`` on a damaged one (caller verifies).

    The frame's declared size is checked first, so a flipped bit there cannot make zstd
    allocate a huge buffer. The descriptor's unused and reserved bits (which this codec never
    sets) must be zero: zstd ignores the unused one, so a flip there would otherwise be the
    one single-bit change in a record that decodes to the same bytes and goes unnoticed.
    """
    if len(frame) < 5 or frame[4] & _FHD_UNUSED_RESERVED:
        raise zstandard.ZstdError("frame header descriptor has unused/reserved bits set")
    if zstandard.frame_content_size(frame) != raw_len:
        raise zstandard.ZstdError(f"frame declares a size other than {raw_len} bytes")
    return _decompressor().decompress(frame, max_output_size=raw_len)
