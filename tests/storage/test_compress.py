"""bf16 byte-plane compression: exact round trip, fallback, damage detection."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hsx_extractor.storage.compress import (
    CODEC_BF16_SPLIT_ZSTD,
    CODEC_RAW,
    CodecError,
    decode_bf16,
    encode_bf16,
    join_planes,
    split_planes,
)
from tests.storage.samples import activations

bf16_arrays = hnp.arrays(np.uint16, hnp.array_shapes(min_dims=1, max_dims=2, max_side=300))


@settings(max_examples=150, deadline=None)
@given(values=bf16_arrays, codec=st.sampled_from([CODEC_RAW, CODEC_BF16_SPLIT_ZSTD]))
def test_any_bits_round_trip_exactly(values: np.ndarray, codec: str) -> None:
    used, stored = encode_bf16(values, codec)
    assert decode_bf16(used, stored, values.size) == values.astype("<u2").tobytes()


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 64), cols=st.integers(1, 512))
def test_activation_like_round_trip_exactly(seed: int, rows: int, cols: int) -> None:
    values = activations(np.random.default_rng(seed), rows, cols)
    used, stored = encode_bf16(values, CODEC_BF16_SPLIT_ZSTD)
    assert decode_bf16(used, stored, values.size) == values.tobytes()


def test_activations_compress_and_noise_falls_back_to_raw() -> None:
    rng = np.random.default_rng(7)
    values = activations(rng, 256, 1024)
    used, stored = encode_bf16(values, CODEC_BF16_SPLIT_ZSTD)
    assert used == CODEC_BF16_SPLIT_ZSTD
    assert len(stored) < 0.85 * values.nbytes
    noise = rng.integers(0, 2**16, 4096, dtype=np.uint16)
    used, stored = encode_bf16(noise, CODEC_BF16_SPLIT_ZSTD)
    assert used == CODEC_RAW and stored == noise.tobytes()


def test_planes_split_high_and_low_bytes() -> None:
    values = np.array([0x3F80, 0xC0A1], dtype=np.uint16)  # 1.0 and about -5.03
    high, low = split_planes(values)
    assert high.tobytes() == b"\x3f\xc0" and low.tobytes() == b"\x80\xa1"
    assert join_planes(high, low).tobytes() == values.tobytes()
    assert join_planes(high.tobytes(), low.tobytes()).tobytes() == values.tobytes()


def test_damaged_frame_is_a_codec_error() -> None:
    values = activations(np.random.default_rng(1), 64, 256)
    used, stored = encode_bf16(values, CODEC_BF16_SPLIT_ZSTD)
    assert used == CODEC_BF16_SPLIT_ZSTD
    damaged = bytearray(stored)
    damaged[0] ^= 0xFF  # zstd magic number
    with pytest.raises(CodecError):
        decode_bf16(used, bytes(damaged), values.size)
    with pytest.raises(CodecError):
        decode_bf16(used, stored[: values.size], values.size)
    with pytest.raises(CodecError):
        decode_bf16("lz77", stored, values.size)


def test_non_bf16_input_is_refused() -> None:
    with pytest.raises(TypeError, match="uint16"):
        encode_bf16(np.zeros(4, dtype=np.float32), CODEC_RAW)
