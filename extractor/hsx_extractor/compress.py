"""Lossless compression of bf16 tensors: byte-plane split, zstd on the high plane.

A bf16 value's high byte is its sign and 7 exponent bits: activations use few exponents, so
that plane compresses well. The low byte (exponent LSB + mantissa) is close to random and
is stored raw. Pure functions over bytes; no I/O.

Stored layout of a ``bf16-split-zstd`` tensor of ``n`` values: one zstd frame of the ``n``
high bytes, followed by the ``n`` low bytes raw. The frame's length is therefore
``stored_len - n``; nothing else is needed to decode.
"""

from __future__ import annotations

import threading
from typing import Final

import numpy as np
import zstandard

CODEC_RAW: Final = "raw"
CODEC_BF16_SPLIT_ZSTD: Final = "bf16-split-zstd"
CODECS: Final = (CODEC_RAW, CODEC_BF16_SPLIT_ZSTD)
ZSTD_LEVEL: Final = 1

# zstd contexts are not thread-safe; one per thread lets callers compress in a pool.
_local = threading.local()


class CodecError(ValueError):
    """Stored bytes cannot be decoded (corrupt data or an unknown codec)."""


def _cctx() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "cctx"):
        _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return _local.cctx  # type: ignore[no-any-return]


def _dctx() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dctx"):
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.dctx  # type: ignore[no-any-return]


def _as_bf16_bits(values: np.ndarray) -> np.ndarray:
    if values.dtype != np.uint16:
        raise TypeError(f"bf16 tensors travel as uint16 bits, got {values.dtype}")
    return np.ascontiguousarray(values).reshape(-1).astype("<u2", copy=False)


def split_planes(values: np.ndarray) -> tuple[bytes, bytes]:
    """(high bytes, low bytes) of little-endian bf16 bits."""
    pairs = _as_bf16_bits(values).view(np.uint8).reshape(-1, 2)
    return pairs[:, 1].tobytes(), pairs[:, 0].tobytes()


def join_planes(high: bytes, low: bytes) -> bytes:
    """Inverse of :func:`split_planes`: interleave the planes back into bf16 bits."""
    if len(high) != len(low):
        raise CodecError(f"plane sizes differ: {len(high)} high, {len(low)} low")
    pairs = np.empty((len(high), 2), dtype=np.uint8)
    pairs[:, 0] = np.frombuffer(low, dtype=np.uint8)
    pairs[:, 1] = np.frombuffer(high, dtype=np.uint8)
    return pairs.tobytes()


def encode_bf16(values: np.ndarray, codec: str) -> tuple[str, bytes]:
    """Encode bf16 bits with ``codec``; returns (codec actually used, stored bytes).

    ``bf16-split-zstd`` falls back to ``raw`` when it would not make the tensor smaller.
    """
    bits = _as_bf16_bits(values)
    raw = bits.tobytes()
    if codec == CODEC_RAW or bits.size == 0:
        return CODEC_RAW, raw
    if codec != CODEC_BF16_SPLIT_ZSTD:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    high, low = split_planes(bits)
    frame = _cctx().compress(high)
    if len(frame) + len(low) >= len(raw):
        return CODEC_RAW, raw
    return CODEC_BF16_SPLIT_ZSTD, frame + low


def decode_bf16(codec: str, stored: bytes | memoryview, num_values: int) -> bytes:
    """The original little-endian bf16 bytes of a tensor of ``num_values`` values."""
    if codec == CODEC_RAW:
        if len(stored) != 2 * num_values:
            raise CodecError(f"raw tensor holds {len(stored)} bytes, expected {2 * num_values}")
        return bytes(stored)
    if codec != CODEC_BF16_SPLIT_ZSTD:
        raise CodecError(f"unknown codec {codec!r}")
    frame_len = len(stored) - num_values
    if frame_len <= 0:
        raise CodecError(f"compressed tensor of {len(stored)} bytes is too short for {num_values} values")
    view = memoryview(stored)
    try:
        high = _dctx().decompress(view[:frame_len], max_output_size=num_values)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame is corrupt: {exc}") from exc
    if len(high) != num_values:
        raise CodecError(f"high plane holds {len(high)} bytes, expected {num_values}")
    return join_planes(high, bytes(view[frame_len:]))
