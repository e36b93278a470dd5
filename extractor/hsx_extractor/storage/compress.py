"""Compression of bf16 tensors: lossless byte-plane split with zstd, and lossy FP8 (storage/fp8.py).

A bf16 value's high byte is its sign and 7 exponent bits: activations use few exponents, so
that plane compresses well. The low byte (exponent LSB + mantissa) is close to random and
is stored raw. Pure functions over bytes; no I/O.

Stored layout of a ``bf16-split-zstd`` tensor of ``n`` values: one zstd frame of the ``n``
high bytes, followed by the ``n`` low bytes raw. The frame's length is therefore
``stored_len - n``; nothing else is needed to decode.

A ``fp8-e4m3-rowscale`` tensor of ``rows`` rows is its ``n`` e4m3 codes followed by ``rows``
float32 scales (storage/fp8.py); it decodes to the bf16 nearest to each dequantized value.
"""

from __future__ import annotations

import threading
from typing import Final, NamedTuple

import numpy as np
import zstandard

from hsx_extractor import protocol
from hsx_extractor.storage import fp8, native

CODEC_RAW: Final = "raw"
CODEC_BF16_SPLIT_ZSTD: Final = "bf16-split-zstd"
CODEC_FP8: Final = "fp8-e4m3-rowscale"  # lossy
CODECS: Final = (CODEC_RAW, CODEC_BF16_SPLIT_ZSTD, CODEC_FP8)
ZSTD_LEVEL: Final = 1
# Level 1 with long minimum matches and a tiny hash table: the high plane has few useful
# matches and is won by entropy coding, so this is ~3x faster than stock level 1 and slightly
# smaller (bench/bench_compression.py). The frames are ordinary zstd frames.
ZSTD_PARAMS: Final = {"window_log": 17, "hash_log": 8, "min_match": 7}

# zstd contexts are not thread-safe; one per thread lets callers compress in a pool.
_local = threading.local()


class CodecError(ValueError):
    """Stored bytes cannot be decoded (corrupt data or an unknown codec)."""


def _cctx() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "cctx"):
        params = zstandard.ZstdCompressionParameters.from_level(
            ZSTD_LEVEL, write_content_size=True, **ZSTD_PARAMS
        )
        _local.cctx = zstandard.ZstdCompressor(compression_params=params)
    return _local.cctx  # type: ignore[no-any-return]


def _dctx() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dctx"):
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.dctx  # type: ignore[no-any-return]


def _as_bf16_bits(values: np.ndarray) -> np.ndarray:
    if values.dtype != np.uint16:
        raise TypeError(f"bf16 tensors travel as uint16 bits, got {values.dtype}")
    return np.ascontiguousarray(values).reshape(-1).astype("<u2", copy=False)


# A bf16 value is Inf or NaN exactly when its 8 exponent bits are all ones, i.e. when its bits without
# the sign are at least 0x7F80.
_BF16_NO_SIGN = np.uint16(0x7FFF)
_BF16_FIRST_NON_FINITE = np.uint16(0x7F80)
COUNT_CHUNK_VALUES: Final = 1 << 18  # bench/stages.py: 64K chunks re-took the GIL too often (two threads slower than one)


def _count_chunk(part: np.ndarray, scratch: np.ndarray) -> int:
    # A chunk's maximum rules out the (rare) bad values in two passes instead of three: 0.10 -> 0.065
    # core-s/GB; only a chunk that has one is counted.
    masked = scratch[: part.size]
    np.bitwise_and(part, _BF16_NO_SIGN, out=masked)
    if masked.size and masked.max() >= _BF16_FIRST_NON_FINITE:
        return int(np.count_nonzero(masked >= _BF16_FIRST_NON_FINITE))
    return 0


def count_non_finite(
    bf16_bits: np.ndarray, chunk: int = COUNT_CHUNK_VALUES, kernels: native.Bf16Kernels | None = None
) -> int:
    """Number of Inf/NaN values in an array of bf16 bit patterns; with ``kernels`` (storage/native.py) in
    one native pass without the GIL, else with numpy, ``chunk`` values at a time."""
    flat = bf16_bits.reshape(-1)
    if kernels is not None and kernels.accepts(flat):
        return kernels.count_non_finite(flat)
    # Chunks with reused buffers stay in cache: ~15x faster than whole-array temporaries,
    # which cost two passes over fresh memory as large as the dump (bench/b1_dataplane.py).
    scratch = np.empty(min(chunk, flat.size), dtype=np.uint16)
    return sum(_count_chunk(flat[start : start + chunk], scratch) for start in range(0, flat.size, chunk))


def split_planes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high bytes, low bytes) of bf16 bits, as contiguous uint8 arrays."""
    bits = _as_bf16_bits(values)
    # Shifts and truncating casts vectorise; strided byte slicing is several times slower.
    return (bits >> 8).astype(np.uint8), bits.astype(np.uint8)


# Planes kept per encoding thread between samples (a 4K-token sample at H=7168 with 3 aux layers needs 235 MB).
PLANE_BUFFERS_KEPT_BYTES: Final = 256 << 20
SPLIT_CHUNK_VALUES: Final = 1 << 18  # bench/stages.py: 64K chunks re-took the GIL too often (x1.1 on 2 threads)


class Planes(NamedTuple):
    """A split tensor: its byte planes, and how many of its values are Inf or NaN (counted as they are read)."""

    high: np.ndarray
    low: np.ndarray
    non_finite: int


class PlaneBuffers:
    """Byte planes written into buffers kept from sample to sample (one set per encoding thread).

    Fresh planes per tensor cost a page fault per 4 KiB touched, more than the split itself
    (issue 17). A plane handed out stays valid until :meth:`reuse`: call it once the previous
    sample's encoded parts are written out.
    """

    def __init__(self, chunk: int = SPLIT_CHUNK_VALUES, kernels: native.Bf16Kernels | None = None) -> None:
        """``kernels``: the native split (storage/native.py; ``native.kernels()`` for this process's),
        None for numpy's, ``chunk`` values at a time."""
        self._buffers: list[np.ndarray] = []
        self._taken = 0
        self._chunk = chunk
        self._shift = np.empty(chunk, dtype=np.uint16)
        self._kernels = kernels

    def reuse(self) -> None:
        if sum(b.size for b in self._buffers) > PLANE_BUFFERS_KEPT_BYTES:
            self._buffers = []  # an unusually long sample: do not hold its size for the rest of the run
        self._taken = 0

    def _take(self, size: int) -> np.ndarray:
        if self._taken == len(self._buffers):
            self._buffers.append(np.empty(0, dtype=np.uint8))
        if self._buffers[self._taken].size < size:
            self._buffers[self._taken] = np.empty(size, dtype=np.uint8)
        out = self._buffers[self._taken][:size]
        self._taken += 1
        return out

    @property
    def kernels(self) -> native.Bf16Kernels | None:
        return self._kernels

    def split(self, values: np.ndarray) -> Planes:
        """Like :func:`split_planes`, into this object's buffers, with the Inf/NaN count of
        :func:`count_non_finite` made on the way: in one native pass, or with numpy a cache-sized chunk
        at a time."""
        bits = _as_bf16_bits(values)
        high, low = self._take(bits.size), self._take(bits.size)
        if self._kernels is not None and self._kernels.accepts(bits):
            return Planes(high, low, self._kernels.split(bits, high, low))  # one pass, without the GIL
        non_finite = 0
        for start in range(0, bits.size, self._chunk):
            part = bits[start : start + self._chunk]
            shifted = self._shift[: part.size]
            np.right_shift(part, 8, out=shifted)
            np.copyto(high[start : start + part.size], shifted, casting="unsafe")
            np.copyto(low[start : start + part.size], part, casting="unsafe")
            non_finite += _count_chunk(part, shifted)  # the chunk is still in cache
        return Planes(high, low, non_finite)


def join_planes(
    high: bytes | memoryview | np.ndarray,
    low: bytes | memoryview | np.ndarray,
    out: np.ndarray | None = None,
    kernels: native.Bf16Kernels | None = None,
) -> np.ndarray:
    """Inverse of :func:`split_planes`: the uint16 bf16 bits (written into ``out`` when given); with
    ``kernels`` (storage/native.py) in one native pass without the GIL."""
    hi = np.frombuffer(high, dtype=np.uint8) if not isinstance(high, np.ndarray) else high
    lo = np.frombuffer(low, dtype=np.uint8) if not isinstance(low, np.ndarray) else low
    if hi.size != lo.size:
        raise CodecError(f"plane sizes differ: {hi.size} high, {lo.size} low")
    # Widened and shifted straight into the result: no uint16 temporary (1.5x faster, bench/reader.py).
    bits = np.empty(hi.size, dtype=np.uint16) if out is None else _checked_out(out, hi.size)
    if kernels is not None and kernels.accepts(hi, lo, bits):
        kernels.join(hi, lo, bits)
        return bits
    np.left_shift(hi, 8, out=bits, dtype=np.uint16)
    np.bitwise_or(bits, lo, out=bits)
    return bits


class EncodedTensor(NamedTuple):
    codec: str  # the codec used (raw where the one asked for does not pay)
    parts: list[bytes | memoryview]  # the stored bytes, to concatenate
    non_finite: int  # Inf/NaN values in the tensor (counted where the encoding reads them, else apart)


def encode_bf16_parts(values: np.ndarray, codec: str, planes: PlaneBuffers | None = None) -> EncodedTensor:
    """Like :func:`encode_bf16`, but the stored bytes as buffers to concatenate (saves a copy), and the
    tensor's Inf/NaN count: the byte-plane split counts them as it reads the values, the other codecs
    count them apart. With ``planes`` the low plane returned lives in its buffers (valid until it is
    reused), and their kernels count."""
    bits = _as_bf16_bits(values)
    kernels = planes.kernels if planes is not None else None
    if codec == CODEC_RAW or bits.size == 0:
        return EncodedTensor(CODEC_RAW, [bits.data.cast("B")], count_non_finite(bits, kernels=kernels))
    if codec == CODEC_FP8:
        non_finite = count_non_finite(bits, kernels=kernels)
        rows = values.shape[0] if values.ndim == 2 else 1
        # Narrow rows: the scales cost more. Inf/NaN: e4m3 has no Inf, and such a tensor is not stored.
        if non_finite or fp8.encoded_length(bits.size, rows) >= 2 * bits.size:
            return EncodedTensor(CODEC_RAW, [bits.data.cast("B")], non_finite)
        codes, scales = fp8.quantize(protocol.bf16_bits_to_f32(bits).reshape(rows, -1))
        return EncodedTensor(CODEC_FP8, [codes.reshape(-1).data, scales.astype("<f4").data.cast("B")], non_finite)
    if codec != CODEC_BF16_SPLIT_ZSTD:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    if planes is not None:
        high, low, non_finite = planes.split(bits)
    else:
        (high, low), non_finite = split_planes(bits), count_non_finite(bits)
    frame = _cctx().compress(high.data)
    if len(frame) + low.size >= 2 * bits.size:  # does not pay: store raw
        return EncodedTensor(CODEC_RAW, [bits.data.cast("B")], non_finite)
    return EncodedTensor(CODEC_BF16_SPLIT_ZSTD, [frame, low.data], non_finite)


def encode_bf16(values: np.ndarray, codec: str) -> tuple[str, bytes]:
    """Encode bf16 bits with ``codec``; returns (codec actually used, stored bytes).

    ``bf16-split-zstd`` falls back to ``raw`` when it would not make the tensor smaller.
    """
    used, parts, _ = encode_bf16_parts(values, codec)
    return used, b"".join(parts)


def _checked_out(out: np.ndarray, num_values: int) -> np.ndarray:
    if out.dtype != np.uint16 or out.shape != (num_values,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint16 array of {num_values} values, got {out.dtype} {out.shape}")
    return out


def decode_bf16_array(
    codec: str,
    stored: bytes | memoryview,
    num_values: int,
    rows: int = 1,
    out: np.ndarray | None = None,
    kernels: native.Bf16Kernels | None = None,
) -> np.ndarray:
    """The bf16 bits of a tensor of ``num_values`` values in ``rows`` rows, as a flat uint16 array
    (the original bits, except for the lossy ``fp8-e4m3-rowscale``). With ``out`` (a flat uint16 array of
    ``num_values``: shared memory a DataLoader worker hands on without a copy) they are written there.
    ``kernels``: the native join (storage/native.py), else numpy's."""
    if out is not None:
        _checked_out(out, num_values)
    if codec == CODEC_FP8:
        if rows < 1 or num_values % rows or len(stored) != fp8.encoded_length(num_values, rows):
            raise CodecError(f"fp8 tensor holds {len(stored)} bytes, not {num_values} codes + {rows} scales")
        view = memoryview(stored)
        codes = np.frombuffer(view[:num_values], dtype=np.uint8).reshape(rows, -1)
        scales = np.frombuffer(view[num_values:], dtype="<f4").astype(np.float32)
        if not np.isfinite(scales).all() or (scales <= 0).any():
            raise CodecError("fp8 tensor has a scale that is not finite and positive")
        bits = protocol.f32_to_bf16_bits(fp8.dequantize(codes, scales)).reshape(-1)
        if out is None:
            return bits
        out[:] = bits
        return out
    if codec == CODEC_RAW:
        if len(stored) != 2 * num_values:
            raise CodecError(f"raw tensor holds {len(stored)} bytes, expected {2 * num_values}")
        if out is None:
            return np.frombuffer(stored, dtype="<u2").copy()
        out[:] = np.frombuffer(stored, dtype="<u2")
        return out
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
    return join_planes(high, view[frame_len:], out, kernels)


def decode_bf16(codec: str, stored: bytes | memoryview, num_values: int, rows: int = 1) -> bytes:
    """The little-endian bf16 bytes of a tensor of ``num_values`` values (see decode_bf16_array)."""
    return decode_bf16_array(codec, stored, num_values, rows).astype("<u2", copy=False).tobytes()
