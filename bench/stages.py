"""The extractor's per-sample stages, each alone: core-seconds per GB of raw hidden states and 1 -> N thread scaling.

    .venv/bin/python -m bench.stages [--tokens 2048] [--hidden 7168] [--rounds 5] [--threads 2]

One sample's dump (3 aux layers + final, bf16, activation-like values as bench_compression makes them) is
written to /dev/shm as the server writes it, then each stage runs as the extractor runs it, on hsx's own code:

  map       protocol-style read-only mapping with MAP_POPULATE (page-table work of the dump)
  validate  storage.compress.count_non_finite (the Inf/NaN scan where the encoding does not make it)
  split     storage.compress.split_planes (bf16 -> high and low byte planes, fresh arrays), and the
            extractor's way since issue 17: PlaneBuffers.split (chunked, into per-thread reused buffers)
  zstd      the codec's zstd on the high plane (storage.compress._cctx)
  xxh3      the sample checksum (storage.shard_format.checksum) over the encoded bytes
  encode    all of a sample's encoding as ShardBuilder.add runs it (storage.shard_format.encode_sample
            with per-thread PlaneBuffers: split, zstd, xxh3), the work the encode threads share
  native    validate, split and encode with the native kernels (storage/native.py), when they are built;
            the native split also counts the Inf/NaN values (the extractor's validation for bf16-zstd)
  spool     writing the encoded bytes to the shard spool: into a reused file or a fresh one, on tmpfs
            (/dev/shm) and on disk ($TMPDIR or /var/tmp), the choice of issue 17 item 6

core-s/GB is the thread CPU time of one stage over one sample (median of --rounds), per GB of raw states.
Scaling runs N copies of the stage on N samples in N threads and compares the wall time with one: 1.0 means
the stage holds the GIL (or a shared resource) for its whole duration, N means it scales with cores. The
baseline in the same run is a plain memcpy of the raw bytes (numpy copy into a reused buffer).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extractor"))
from bench.bench_compression import activation_like
from bench.common import rmtree, scratch, write_result
from hsx_extractor.storage import native
from hsx_extractor.storage.compress import (
    CODEC_BF16_SPLIT_ZSTD,
    SPLIT_CHUNK_VALUES,
    PlaneBuffers,
    _cctx,
    count_non_finite,
    split_planes,
)
from hsx_extractor.storage.shard_format import SampleRecord, checksum, encode_sample
from hsx_extractor.storage.spool import pwrite_all

GB = 1e9
LAYERS = 4  # 3 aux + final


def make_dump(directory: Path, tokens: int, hidden: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    values = np.concatenate([activation_like(rng, tokens, hidden, 0.5, True) for _ in range(LAYERS)])
    path = directory / f"dump-{seed}.bin"
    path.write_bytes(values.tobytes())
    return path


def mapped(path: Path) -> np.ndarray:
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        view = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    return np.frombuffer(view, dtype=np.uint16)


class Sample:
    """One dump and the intermediate results each later stage starts from (computed once, untimed)."""

    def __init__(self, path: Path, spool_dirs: dict[str, Path], hidden: int):
        self.path = path
        self.bits = mapped(path)
        self.high, self.low = split_planes(self.bits)
        self.frame = _cctx().compress(self.high.data)
        self.encoded = [self.frame, self.low.data]
        self.copy_into = np.empty_like(self.bits)
        tokens = self.bits.size // (LAYERS * hidden)
        aux_values = (LAYERS - 1) * tokens * hidden  # the aux block [L, K*H], then the final [L, H]
        aux = self.bits[:aux_values].reshape(tokens, (LAYERS - 1) * hidden)
        final = self.bits[aux_values:].reshape(tokens, hidden)
        ids = np.arange(tokens, dtype=np.int32)
        self.record = SampleRecord(0, "s", ids, np.ones(tokens, dtype=np.uint8), aux, final)
        self.spool_dirs = spool_dirs
        self.reused = {name: tempfile.TemporaryFile(dir=d) for name, d in spool_dirs.items()}  # noqa: SIM115 (close())
        for f in self.reused.values():  # the reused file's blocks already exist, as after the first shard
            pwrite_all(f.fileno(), self.encoded, 0)

    @property
    def raw_bytes(self) -> int:
        return int(self.bits.nbytes)

    def close(self) -> None:
        for f in self.reused.values():
            f.close()


_local = threading.local()


def _planes(chunk: int | None = None, kernels: native.Bf16Kernels | None = None) -> PlaneBuffers:
    """This thread's plane buffers: numpy's split (the extractor's chunk size unless ``chunk``), or the
    native kernels' when given."""
    name = f"planes{chunk}{kernels is not None}"
    if not hasattr(_local, name):
        setattr(_local, name, PlaneBuffers(chunk or SPLIT_CHUNK_VALUES, kernels))
    return getattr(_local, name)  # type: ignore[no-any-return]


def _fresh_spool(sample: Sample, where: str) -> None:
    with tempfile.TemporaryFile(dir=sample.spool_dirs[where]) as f:
        pwrite_all(f.fileno(), sample.encoded, 0)


def stages(spool_dirs: dict[str, Path]) -> dict[str, Callable[[Sample], object]]:
    out: dict[str, Callable[[Sample], object]] = {
        "baseline memcpy": lambda s: np.copyto(s.copy_into, s.bits),
        "map": lambda s: mapped(s.path),
        "validate": lambda s: count_non_finite(s.bits),
        **{
            f"validate chunk={chunk >> 10}K": (lambda s, c=chunk: count_non_finite(s.bits, c))
            for chunk in (1 << 16, 1 << 20)
        },
        "split fresh": lambda s: split_planes(s.bits),
        "split reused": lambda s: _planes().split(s.bits) and _planes().reuse(),
        **{
            f"split reused chunk={chunk >> 10}K": (lambda s, c=chunk: _planes(c).split(s.bits) and _planes(c).reuse())
            for chunk in (1 << 16, 1 << 20)
        },
        "zstd": lambda s: _cctx().compress(s.high.data),
        "xxh3": lambda s: checksum(s.frame) + checksum(s.low.data),
        "encode": lambda s: encode_sample(s.record, CODEC_BF16_SPLIT_ZSTD, _planes()) and _planes().reuse(),
    }
    kernels = native.kernels()
    if kernels is not None:  # the extractor's way where the library is built (storage/native.py)
        out |= {
            "validate native": lambda s: count_non_finite(s.bits, kernels=kernels),
            "split native": lambda s: _planes(kernels=kernels).split(s.bits) and _planes(kernels=kernels).reuse(),
            "encode native": lambda s: (encode_sample(s.record, CODEC_BF16_SPLIT_ZSTD, _planes(kernels=kernels))
                                        and _planes(kernels=kernels).reuse()),
        }
    for where in spool_dirs:
        out[f"spool reused ({where})"] = lambda s, w=where: pwrite_all(s.reused[w].fileno(), s.encoded, 0)
        out[f"spool fresh ({where})"] = lambda s, w=where: _fresh_spool(s, w)
    return out


def thread_cpu(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def scaling(fn: Callable[[Sample], object], samples: list[Sample], threads: int, repeats: int = 3) -> float:
    """Speed-up of `threads` concurrent runs (one sample each) over one run, by wall time (best of repeats)."""

    def wall(n: int) -> float:
        best = float("inf")
        with ThreadPoolExecutor(n) as pool:
            for _ in range(repeats):
                barrier = threading.Barrier(n)

                def one(s: Sample, gate: threading.Barrier = barrier) -> None:
                    gate.wait()
                    fn(s)

                start = time.perf_counter()
                list(pool.map(one, samples[:n]))
                best = min(best, time.perf_counter() - start)
        return best

    one_alone = wall(1)
    return threads * one_alone / wall(threads)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="N for the 1 -> N scaling")
    args = p.parse_args(argv)

    shm = scratch("stages", shm=True)
    disk = Path(tempfile.mkdtemp(prefix="hsx-bench-stages-", dir=os.environ.get("TMPDIR") or "/var/tmp"))
    spool_dirs = {"tmpfs": shm, "disk": disk}
    samples: list[Sample] = []
    try:
        samples = [Sample(make_dump(shm, args.tokens, args.hidden, seed), spool_dirs, args.hidden) for seed in range(args.threads)]
        raw = samples[0].raw_bytes
        results: dict[str, Any] = {}
        for name, fn in stages(spool_dirs).items():
            rounds = [thread_cpu(lambda f=fn: f(samples[0])) * GB / raw for _ in range(args.rounds)]
            results[name] = {
                "core_s_per_gb": statistics.median(rounds),
                "rounds": rounds,
                f"speedup_1_to_{args.threads}_threads": scaling(fn, samples, args.threads),
            }
            r = results[name]
            print(
                f"{name:24s} {r['core_s_per_gb']:7.3f} core-s/GB   "
                f"x{r[f'speedup_1_to_{args.threads}_threads']:.2f} on {args.threads} threads",
                flush=True,
            )
        ratio = {k: v["core_s_per_gb"] / results["baseline memcpy"]["core_s_per_gb"] for k, v in results.items()}
        data = {
            "params": vars(args),
            "raw_bytes_per_sample": raw,
            "stages": results,
            "vs_memcpy": ratio,
        }
        path = write_result("stages", data)
        print(f"wrote {path}")
        return data
    finally:
        for s in samples:
            s.close()
        rmtree(shm)
        rmtree(disk)


if __name__ == "__main__":
    main()
