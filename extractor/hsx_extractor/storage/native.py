"""hsx's native bf16 kernels (bf16_kernels.c): the byte-plane split, its inverse and the Inf/NaN count, loaded with ctypes.

ctypes releases the GIL for the call, so encoding and validation threads split and scan in parallel;
one pass over the values replaces numpy's chunked shift, casts and reductions (bench/stages.py), and the
reader joins the planes in one pass instead of numpy's two (bench/reader.py).
The library is optional: without it numpy does the same work, bit for bit (tests/storage/test_native.py).

Where it is looked for (``HSX_NATIVE_LIB``):
  unset   ``_hsx_bf16.so`` beside this module (``make`` builds it there for the dev venv); numpy if absent
  a path  that library; one that cannot be loaded is a configuration error (the extractor image sets this)
  ``off`` numpy

Build: ``python -m hsx_extractor.storage.native build DIR`` (a C compiler: ``$CC`` or ``cc``).
Imports nothing but the standard library, so the image's build stage needs no numpy.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import numpy as np

LIBRARY_ENV: Final = "HSX_NATIVE_LIB"
LIBRARY_OFF: Final = "off"
LIBRARY_NAME: Final = "_hsx_bf16.so"
SOURCE: Final = Path(__file__).with_name("bf16_kernels.c")
ABI: Final = 3  # hsx_bf16_abi() of a library built from this checkout's bf16_kernels.c
CFLAGS: Final = ("-O3", "-shared", "-fPIC", "-std=c99", "-Wall", "-Wextra", "-Werror")


class NativeLibraryError(RuntimeError):
    """The library named by HSX_NATIVE_LIB cannot be used (a configuration error: fix the image or unset it)."""


class Bf16Kernels:
    """The kernels of one loaded library. Arrays must be C-contiguous and aligned (:meth:`accepts`)."""

    def __init__(self, path: Path) -> None:
        try:
            lib = ctypes.CDLL(str(path))
            abi = ctypes.CFUNCTYPE(ctypes.c_uint32)(("hsx_bf16_abi", lib))()
        except (OSError, AttributeError) as exc:
            raise NativeLibraryError(f"cannot load the bf16 kernels from {path}: {exc}") from exc
        if abi != ABI:
            raise NativeLibraryError(f"{path} was built from another hsx (kernel ABI {abi}, this hsx needs {ABI})")
        self.path = path
        self._split = lib.hsx_bf16_split
        self._split.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self._split.restype = ctypes.c_size_t
        self._join = lib.hsx_bf16_join
        self._join.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self._join.restype = None
        self._count = lib.hsx_bf16_count_non_finite
        self._count.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._count.restype = ctypes.c_size_t

    @staticmethod
    def accepts(*arrays: np.ndarray) -> bool:
        return all(a.flags.c_contiguous and a.flags.aligned for a in arrays)

    def _check_planes(self, kernel: str, bits: np.ndarray, high: np.ndarray, low: np.ndarray) -> None:
        if bits.dtype.itemsize != 2 or high.dtype.itemsize != 1 or low.dtype.itemsize != 1:
            raise TypeError(f"{kernel} takes uint16 bits and uint8 planes, got {bits.dtype}, {high.dtype}, {low.dtype}")
        if not (bits.size == high.size == low.size) or not self.accepts(bits, high, low):
            raise ValueError(f"{kernel} needs contiguous, aligned arrays of one length")

    def split(self, bits: np.ndarray, high: np.ndarray, low: np.ndarray) -> int:
        """``high[i] = bits[i] >> 8`` and ``low[i] = bits[i] & 0xFF`` for flat uint16 ``bits`` and uint8 planes;
        returns the number of Inf/NaN values among ``bits`` (:meth:`count_non_finite`, in the same pass)."""
        self._check_planes("split", bits, high, low)
        return int(self._split(bits.ctypes.data, high.ctypes.data, low.ctypes.data, bits.size))

    def join(self, high: np.ndarray, low: np.ndarray, bits: np.ndarray) -> None:
        """``bits[i] = high[i] << 8 | low[i]``: the inverse of :meth:`split`."""
        self._check_planes("join", bits, high, low)
        self._join(high.ctypes.data, low.ctypes.data, bits.ctypes.data, bits.size)

    def count_non_finite(self, bits: np.ndarray) -> int:
        """Number of Inf/NaN values among contiguous bf16 bit patterns."""
        if bits.dtype.itemsize != 2 or not self.accepts(bits):
            raise ValueError(f"count_non_finite takes contiguous, aligned uint16 bits, got {bits.dtype}")
        return int(self._count(bits.ctypes.data, bits.size))


def default_path() -> Path:
    return Path(__file__).with_name(LIBRARY_NAME)


def load(setting: str | None) -> Bf16Kernels | None:
    """The kernels for an ``HSX_NATIVE_LIB`` value (see the module doc); None means numpy."""
    if setting == LIBRARY_OFF:
        return None
    if setting:
        try:
            return Bf16Kernels(Path(setting))
        except NativeLibraryError as exc:
            raise NativeLibraryError(f"{LIBRARY_ENV}={setting}: {exc} (unset it or set it to {LIBRARY_OFF!r} for numpy)") from exc
    return Bf16Kernels(default_path()) if default_path().exists() else None


@functools.cache
def kernels() -> Bf16Kernels | None:
    """This process's kernels, from ``HSX_NATIVE_LIB`` (loaded once); None means numpy."""
    return load(os.environ.get(LIBRARY_ENV))


def describe(found: Bf16Kernels | None) -> str:
    if found is not None:
        return f"native ({found.path})"
    why = f"{LIBRARY_ENV}={LIBRARY_OFF}" if os.environ.get(LIBRARY_ENV) == LIBRARY_OFF else "not built"
    return f"numpy ({why}: the split, the reader's join and the Inf/NaN scan take more CPU, docs/guide.md)"


def build(out_dir: Path, cc: str | None = None) -> Path:
    """Compile bf16_kernels.c into ``out_dir``; returns the library's path (replaced atomically)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY_NAME
    partial = out_dir / f".{LIBRARY_NAME}.{os.getpid()}"
    compiler = cc or os.environ.get("CC") or "cc"
    try:
        subprocess.run([compiler, *CFLAGS, "-o", str(partial), str(SOURCE)], check=True)
        Bf16Kernels(partial)  # refuse to install a library that does not load
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "build":
        print(build(Path(args[1])))
        return 0
    if args == ["status"]:
        print(describe(kernels()))
        return 0
    print("usage: python -m hsx_extractor.storage.native build DIR | status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
