"""The native bf16 kernels (storage/native.py), built here with the machine's C compiler, against numpy's
reference implementations, and the loader's answers to each HSX_NATIVE_LIB setting."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hsx_extractor.storage import native
from hsx_extractor.storage.compress import (
    CODEC_BF16_SPLIT_ZSTD,
    PlaneBuffers,
    count_non_finite,
    decode_bf16_array,
    encode_bf16,
    join_planes,
    split_planes,
)

SIZES = [0, 1, 2, 31, 32, 33, 63, 64, 65, 4099, 0xFFFF, 0xFFFF + 1, 3 * 0xFFFF + 7, (1 << 18) + 5]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> native.Bf16Kernels:
    if shutil.which("cc") is None:
        pytest.fail("the native kernels need a C compiler (cc) to be tested")
    path = native.build(tmp_path_factory.mktemp("native"))
    return native.Bf16Kernels(path)


def _random_bits(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 16, size=n, dtype=np.uint16)


@pytest.mark.parametrize("n", SIZES)
def test_split_matches_numpy_bit_for_bit(kernels: native.Bf16Kernels, n: int) -> None:
    bits = _random_bits(n, n)
    high, low = np.full(n, 7, np.uint8), np.full(n, 7, np.uint8)
    non_finite = kernels.split(bits, high, low)
    want_high, want_low = split_planes(bits)
    assert np.array_equal(high, want_high) and np.array_equal(low, want_low)
    assert non_finite == count_non_finite(bits)


@pytest.mark.parametrize("n", SIZES)
def test_join_matches_numpy_bit_for_bit(kernels: native.Bf16Kernels, n: int) -> None:
    high, low = split_planes(_random_bits(n, n + 2))
    bits = np.full(n, 7, np.uint16)
    kernels.join(high, low, bits)
    assert np.array_equal(bits, join_planes(high, low))


def test_the_reader_decodes_natively_into_its_buffer(kernels: native.Bf16Kernels) -> None:
    bits = _random_bits(300 * 64, 5) & 0x3FFF  # finite, compressible
    used, stored = encode_bf16(bits, CODEC_BF16_SPLIT_ZSTD)
    assert used == CODEC_BF16_SPLIT_ZSTD
    out = np.zeros(bits.size, np.uint16)
    decoded = decode_bf16_array(used, stored, bits.size, rows=300, out=out, kernels=kernels)
    assert decoded is out and np.array_equal(out, bits)
    assert np.array_equal(decode_bf16_array(used, memoryview(stored), bits.size, rows=300), bits)  # numpy's way


def test_plane_buffers_split_natively_into_their_reused_buffers(kernels: native.Bf16Kernels) -> None:
    planes = PlaneBuffers(kernels=kernels)
    for n in (5000, 300, 5000):
        planes.reuse()
        bits = _random_bits(n, 3 * n).reshape(-1, 100)
        high, low, non_finite = planes.split(bits)
        want_high, want_low = split_planes(bits)
        assert np.array_equal(high, want_high) and np.array_equal(low, want_low)
        assert non_finite == count_non_finite(bits) > 0


def test_count_non_finite_matches_numpy_on_every_bit_pattern(kernels: native.Bf16Kernels) -> None:
    every = np.arange(1 << 16, dtype=np.uint16)
    # Exponent all ones: 0x7F80-0x7FFF and, with the sign, 0xFF80-0xFFFF.
    assert kernels.count_non_finite(every) == count_non_finite(every) == 256
    high, low = np.empty(every.size, np.uint8), np.empty(every.size, np.uint8)
    assert kernels.split(every, high, low) == 256  # the split counts the same values


@pytest.mark.parametrize("n", SIZES)
def test_count_non_finite_counts_past_its_16_bit_blocks(kernels: native.Bf16Kernels, n: int) -> None:
    # All NaN: every block of 0xFFFF values is counted in full (a 16-bit lane must not wrap).
    nans = np.full(n, 0x7FC0, np.uint16)
    assert kernels.count_non_finite(nans) == n
    assert kernels.split(nans, np.empty(n, np.uint8), np.empty(n, np.uint8)) == n
    bits = _random_bits(n, n + 1)
    assert kernels.count_non_finite(bits) == count_non_finite(bits)


def test_unaligned_bits_are_refused_by_the_kernel_and_counted_by_numpy(kernels: native.Bf16Kernels) -> None:
    raw = bytearray(2 * 1001 + 1)
    bits = np.frombuffer(raw, dtype=np.uint16, offset=1)
    assert not bits.flags.aligned
    with pytest.raises(ValueError, match="aligned"):
        kernels.count_non_finite(bits)
    assert count_non_finite(bits, kernels=kernels) == 0


def test_the_loader_follows_hsx_native_lib(kernels: native.Bf16Kernels, tmp_path: Path) -> None:
    assert native.load(native.LIBRARY_OFF) is None
    assert native.load(str(kernels.path)).path == kernels.path  # type: ignore[union-attr]
    with pytest.raises(native.NativeLibraryError, match=f"{native.LIBRARY_ENV}=.*nowhere.so.*'off'"):
        native.load(str(tmp_path / "nowhere.so"))


def _compile(tmp_path: Path, name: str, source: str) -> Path:
    src, lib = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
    src.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_a_library_of_another_abi_or_without_the_kernels_is_refused(tmp_path: Path) -> None:
    other = _compile(tmp_path, "other", "unsigned hsx_bf16_abi(void) { return 999; }\n")
    with pytest.raises(native.NativeLibraryError, match="ABI 999"):
        native.load(str(other))
    unrelated = _compile(tmp_path, "unrelated", "int something_else(void) { return 0; }\n")
    with pytest.raises(native.NativeLibraryError, match="hsx_bf16_abi"):
        native.load(str(unrelated))
