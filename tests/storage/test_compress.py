"""bf16 byte-plane compression: exact round trip, fallback, damage detection."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hsx_extractor.storage.compress import (
    CODEC_BF16_SPLIT_ZSTD,
    CODEC_FP8,
    CODEC_RAW,
    SPLIT_CHUNK_VALUES,
    CodecError,
    PlaneBuffers,
    count_non_finite,
    decode_bf16,
    encode_bf16,
    encode_bf16_parts,
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


# ------------------------------------------------------------------ fp8-e4m3-rowscale (lossy)


def test_the_e4m3_table_is_torchs_float8_e4m3fn() -> None:
    torch = pytest.importorskip("torch")
    from hsx_extractor.storage import fp8

    theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(fp8.VALUES), np.isnan(theirs))
    finite = ~np.isnan(theirs)
    assert np.array_equal(fp8.VALUES[finite], theirs[finite]) and fp8.VALUES[0x7E] == fp8.E4M3_MAX


def test_quantize_rounds_as_torch_does() -> None:
    """Every value torch converts to e4m3fn (round to nearest even) gets the same code here."""
    torch = pytest.importorskip("torch")
    from hsx_extractor.storage import fp8

    rng = np.random.default_rng(5)
    values = (rng.standard_normal((64, 512)) * rng.lognormal(0, 2, (64, 1))).astype(np.float32)
    values[0, :4] = [0.0, -0.0, 1e-30, -1e-30]  # zeros and values below the smallest subnormal
    codes, scales = fp8.quantize(values)
    scaled = torch.from_numpy(values) / torch.from_numpy(scales)[:, None]
    theirs = scaled.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(codes, theirs)
    # Ties (exact midpoints between codes) go to the even code, as torch's conversion does.
    mids = torch.from_numpy(((fp8.VALUES[1:0x7E] + fp8.VALUES[2:0x7F]) / 2).astype(np.float32))
    tie_codes, _ = fp8.quantize(np.concatenate([[fp8.E4M3_MAX], mids.numpy()])[None].astype(np.float32))
    assert np.array_equal(tie_codes[0, 1:], mids.to(torch.float8_e4m3fn).view(torch.uint8).numpy())


def test_fp8_round_trip_error_is_bounded_per_token() -> None:
    from hsx_extractor.protocol import bf16_bits_to_f32, f32_to_bf16_bits
    from hsx_extractor.storage.compress import CODEC_FP8, decode_bf16_array, encode_bf16

    values = activations(np.random.default_rng(3), 300, 1024)  # bf16 bits shaped like hidden states
    used, stored = encode_bf16(values, CODEC_FP8)
    assert used == CODEC_FP8 and len(stored) == values.size + 4 * 300  # half of bf16, plus the scales
    back = bf16_bits_to_f32(decode_bf16_array(used, stored, values.size, rows=300)).reshape(300, 1024)
    orig = bf16_bits_to_f32(values).reshape(300, 1024)
    amax = np.abs(orig).max(axis=1, keepdims=True)
    # 3 mantissa bits: within 1/16 relative for values in e4m3's normal range, plus one bf16 rounding
    normal = np.abs(orig) >= amax * 2.0**-6 / 448 * 256
    rel = np.abs(back - orig)[normal] / np.abs(orig)[normal]
    assert rel.max() <= 1 / 16 + 2**-8
    cosine = (back * orig).sum(axis=1) / np.linalg.norm(back, axis=1) / np.linalg.norm(orig, axis=1)
    assert cosine.min() > 0.998
    assert np.array_equal(f32_to_bf16_bits(back).reshape(-1), decode_bf16_array(used, stored, values.size, 300))


def test_fp8_damage_and_hostile_scales_are_refused() -> None:
    from hsx_extractor.storage.compress import CODEC_FP8, decode_bf16_array, encode_bf16

    values = activations(np.random.default_rng(4), 8, 64)
    used, stored = encode_bf16(values, CODEC_FP8)
    with pytest.raises(CodecError, match="not 512 codes \\+ 8 scales"):
        decode_bf16_array(used, stored[:-1], values.size, rows=8)
    bad = bytearray(stored)
    bad[-4:] = np.array([np.inf], dtype="<f4").tobytes()
    with pytest.raises(CodecError, match="scale"):
        decode_bf16_array(used, bytes(bad), values.size, rows=8)


def test_fp8_falls_back_to_raw_when_rows_are_too_narrow_to_pay_for_their_scales() -> None:
    from hsx_extractor.storage.compress import CODEC_FP8, encode_bf16

    values = activations(np.random.default_rng(5), 100, 4)
    assert encode_bf16(values, CODEC_FP8)[0] == CODEC_RAW


@pytest.mark.parametrize("size", [0, 1, SPLIT_CHUNK_VALUES - 1, SPLIT_CHUNK_VALUES, 3 * SPLIT_CHUNK_VALUES + 7])
def test_planes_split_into_reused_buffers_equal_a_fresh_split(size: int) -> None:
    bits = np.random.default_rng(size).integers(0, 1 << 16, size, dtype=np.uint16)
    planes = PlaneBuffers()
    high, low, _ = planes.split(bits)
    want_high, want_low = split_planes(bits)
    assert np.array_equal(high, want_high) and np.array_equal(low, want_low)


def test_plane_buffers_are_reused_only_after_reuse() -> None:
    planes = PlaneBuffers()
    a = np.arange(1000, dtype=np.uint16)
    first_high, first_low, _ = planes.split(a)
    second_high, _, _ = planes.split(a[:500])  # same sample: new buffers, the first planes stay intact
    assert not np.shares_memory(first_high, second_high)
    assert np.array_equal(first_low, split_planes(a)[1])
    planes.reuse()
    again_high, _, _ = planes.split(a[::-1].copy())  # next sample: the first buffer again
    assert np.shares_memory(again_high, first_high)
    assert np.array_equal(again_high, split_planes(a[::-1].copy())[0])


def test_encoding_with_plane_buffers_stores_the_same_bytes() -> None:
    values = np.random.default_rng(7).integers(0x3C00, 0x4200, 5000, dtype=np.uint16)
    used, parts, _ = encode_bf16_parts(values, CODEC_BF16_SPLIT_ZSTD, PlaneBuffers())
    assert (used, b"".join(bytes(p) for p in parts)) == encode_bf16(values, CODEC_BF16_SPLIT_ZSTD)


def test_plane_buffers_let_go_of_an_unusually_long_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    from hsx_extractor.storage import compress

    monkeypatch.setattr(compress, "PLANE_BUFFERS_KEPT_BYTES", 4000)
    planes = PlaneBuffers()
    small_high, _, _ = planes.split(np.arange(1000, dtype=np.uint16))  # 2,000 bytes of planes: kept
    planes.reuse()
    assert np.shares_memory(planes.split(np.arange(1000, dtype=np.uint16))[0], small_high)
    planes.reuse()
    long_high, _, _ = planes.split(np.arange(3000, dtype=np.uint16))  # 6,000 bytes: given up after this sample
    planes.reuse()
    again, _, _ = planes.split(np.arange(1000, dtype=np.uint16))
    assert not np.shares_memory(again, long_high)


def test_largest_finite_bf16_is_finite() -> None:
    assert count_non_finite(np.array([0x7F7F, 0xFF7F, 0x0001, 0x8000], np.uint16)) == 0
    assert count_non_finite(np.array([0x7F80, 0x7FFF, 0x1], np.uint16)) == 2
    assert count_non_finite(np.array([0xFF80, 0xFFC1, 0xFF7F, 0x7FC0], np.uint16)) == 3  # -inf, -NaN, NaN


def test_non_finite_count_is_the_same_across_chunk_edges() -> None:
    bits = np.random.default_rng(5).integers(0, 1 << 16, (37, 23), dtype=np.uint16)
    expected = int(np.count_nonzero((bits & 0x7F80) == 0x7F80))
    assert expected > 0
    for chunk in (1, 7, 64, 851, 10_000):
        assert count_non_finite(bits, chunk=chunk) == expected
    assert count_non_finite(np.empty((0, 4), np.uint16)) == 0


@pytest.mark.parametrize("chunk", [1, 7, 64, 851, 10_000])
def test_plane_buffers_count_what_count_non_finite_counts(chunk: int) -> None:
    bits = np.random.default_rng(chunk).integers(0, 1 << 16, (37, 23), dtype=np.uint16)
    high, low, non_finite = PlaneBuffers(chunk=chunk).split(bits)
    assert non_finite == count_non_finite(bits) > 0
    assert np.array_equal(high, split_planes(bits)[0]) and np.array_equal(low, split_planes(bits)[1])


@pytest.mark.parametrize("codec", [CODEC_RAW, CODEC_BF16_SPLIT_ZSTD, CODEC_FP8])
@pytest.mark.parametrize("planes", [False, True])
def test_every_codec_reports_the_tensors_non_finite_values(codec: str, planes: bool) -> None:
    values = activations(np.random.default_rng(2), 64, 256)
    assert encode_bf16_parts(values, codec, PlaneBuffers() if planes else None).non_finite == 0
    values[3, 5], values[60, 1] = 0x7FC0, 0xFF80  # NaN, -Inf
    assert encode_bf16_parts(values, codec, PlaneBuffers() if planes else None).non_finite == 2
