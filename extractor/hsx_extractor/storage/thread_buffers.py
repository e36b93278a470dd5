"""Buffers kept per thread: the encoder's byte planes and the reader's sample buffer (fresh pages for
every sample cost more than the work done in them)."""

from __future__ import annotations

import threading
from typing import Final

from hsx_extractor.storage import native
from hsx_extractor.storage.compress import PlaneBuffers

_local = threading.local()


def thread_planes() -> PlaneBuffers:
    if not hasattr(_local, "planes"):
        _local.planes = PlaneBuffers(kernels=native.kernels())
    return _local.planes  # type: ignore[no-any-return]


# A sample's stored bytes are read into a buffer kept per thread: fresh pages for every read cost
# the trainer's reader a quarter of its CPU (bench/reader.py, bf16-zstd: 1.14 -> 0.91 core-s per GB).
# Larger samples get their own.
READ_BUFFER_KEPT_BYTES: Final = 256 << 20


def read_buffer(length: int) -> memoryview:
    if length > READ_BUFFER_KEPT_BYTES:
        return memoryview(bytearray(length))
    kept: bytearray | None = getattr(_local, "read_buffer", None)
    if kept is None or len(kept) < length:
        kept = _local.read_buffer = bytearray(length)
    return memoryview(kept)[:length]
