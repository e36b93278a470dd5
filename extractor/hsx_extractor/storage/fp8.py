"""FP8 E4M3 (the ``e4m3fn`` variant: no infinities, 448 max) with one scale per token. Pure numpy.

The lossy codec ``fp8-e4m3-rowscale`` (output.compression ``fp8-e4m3``) stores each row of a
[tokens, width] tensor as ``width`` e4m3 codes of ``value / scale`` with ``scale = max|row| / 448``,
followed by the rows' scales as little-endian float32. Per-token scales keep a token whose
activations are small (most of them) from losing its precision to an outlier token's range.
numpy has no fp8 type: values are rounded to the nearest code (ties to the even code) on float32's
bits, as torch's conversion does (tested against it), and decoded through a table of the 256 codes.
"""

from __future__ import annotations

from typing import Final

import numpy as np

E4M3_MAX: Final = 448.0
SCALE_BYTES: Final = 4  # one float32 per row


def _code_values() -> np.ndarray:
    """float32 value of every e4m3fn code (0x7F and 0xFF are NaN)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    normal = (1.0 + man / 8.0) * np.exp2(exp.astype(np.float64) - 7.0)
    subnormal = (man / 8.0) * 2.0**-6
    values = sign * np.where(exp == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


VALUES: Final = _code_values()
_SMALLEST_NORMAL: Final = np.float32(2.0**-6)


def quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes of the same shape, float32 scale per row) of finite float32 ``values`` [rows, cols].

    Rounds on float32's bits: adding half an e4m3 step (ties to even) and dropping 20 mantissa
    bits leaves exponent and 3 mantissa bits, rebiased from 127 to 7; subnormals (below 2^-6)
    are multiples of 2^-9, rounded with rint (ties to even)."""
    rows = np.asarray(values, dtype=np.float32).reshape(values.shape[0], -1)
    amax = np.abs(rows).max(axis=1) if rows.size else np.zeros(rows.shape[0], np.float32)
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    scaled = rows / scales[:, None]
    magnitude = np.minimum(np.abs(scaled), np.float32(E4M3_MAX))
    bits = magnitude.view(np.uint32)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20).astype(np.int32) - (120 << 3)
    subnormal = np.rint(magnitude * np.float32(512.0)).astype(np.int32)
    codes = np.where(magnitude < _SMALLEST_NORMAL, subnormal, normal).astype(np.uint8)
    codes |= np.signbit(scaled).astype(np.uint8) << 7
    return codes.reshape(values.shape), scales


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values of ``codes`` [rows, ...] times each row's scale."""
    rows = codes.reshape(scales.shape[0], -1)
    return (VALUES[rows] * scales[:, None]).reshape(codes.shape)


def encoded_length(num_values: int, rows: int) -> int:
    return num_values + SCALE_BYTES * rows
