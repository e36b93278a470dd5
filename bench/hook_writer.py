"""The SGLang hook's dump writers driven flat out, without SGLang: can they carry a saturated server?

    .venv/bin/python -m bench.hook_writer [--rounds 5] [--tokens 2048] [--chunks 8]

A "scheduler" thread submits whole requests' staged bf16 rows (H=7168, 3 aux layers: 57,344 B per
token) as fast as the writers take them; the dumps land in /dev/shm like the pod's dump volume and a
consumer thread deletes them as the extractor would. Per variant: GB/s written, core-seconds per GB
(process CPU, user + system, over the round) and the share of wall time the submitting thread was
blocked in ``submit`` (what the scheduler would lose). The baseline is round 1's writer (one thread,
``torch.cat`` of the chunks and a torch conversion) in the same run. Tokens per second are GB/s over
57,344 B; a saturated 8-GPU prefill of a 7168-hidden model is 40-100k tok/s (2.3-5.7 GB/s). The paced
variants submit at 25k, 50k and 100k tok/s, as a scheduler producing dumps at that rate would: the share
of wall time ``submit`` blocked is what the scheduler would lose at that rate.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import cpu_seconds, rmtree, scratch, write_result
from hsx_extractor import protocol
from hsx_extractor.sglang_hook import writer as hook_writer

HIDDEN = 7168
NUM_AUX = 3
BYTES_PER_TOKEN = (NUM_AUX + 1) * HIDDEN * 2
DEFAULT_THREADS = hook_writer.DEFAULT_WRITER_THREADS


def _round1_run_job(dump_dir: Path, job: hook_writer.DumpJob | hook_writer.ErrorJob) -> Path:
    """Round 1's write path, kept here as the baseline: join chunks and convert with torch ops."""
    assert isinstance(job, hook_writer.DumpJob)

    def joined(chunks: list[hook_writer.Staged]) -> np.ndarray:
        parts = [c.wait() for c in chunks]
        rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if rows.dtype != torch.bfloat16:
            rows = rows.to(torch.bfloat16)
        return rows.contiguous().view(torch.int16).numpy()

    return protocol.write_dump(dump_dir, job.meta, job.input_ids, joined(job.aux), joined(job.final))


class _Consumer(threading.Thread):
    """Deletes finished dumps, as the extractor does once it has read them."""

    def __init__(self, dump_dir: Path) -> None:
        super().__init__(daemon=True)
        self.dump_dir, self.stop = dump_dir, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            with os.scandir(self.dump_dir) as entries:
                for e in entries:
                    if e.name.endswith(".safetensors"):
                        os.unlink(e.path)
            time.sleep(0.002)


def _jobs(tokens: int, chunks: int, requests: int) -> list[hook_writer.DumpJob]:
    aux = torch.randn(tokens, NUM_AUX * HIDDEN).to(torch.bfloat16)
    final = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    bounds = np.linspace(0, tokens, chunks + 1).astype(int)
    ids = np.arange(tokens, dtype=np.int32)
    jobs = []
    for i in range(requests):
        meta = protocol.DumpMeta(f"hsx-bench-{i}-a0", tokens, HIDDEN, (2, 3, 4), "bench")
        aux_chunks = [hook_writer.stage(aux[a:b]) for a, b in itertools.pairwise(bounds)]
        final_chunks = [hook_writer.stage(final[a:b]) for a, b in itertools.pairwise(bounds)]
        jobs.append(hook_writer.DumpJob(meta, ids, aux_chunks, final_chunks))
    return jobs


def _one_round(
    threads: int, chunks: int, tokens: int, requests: int, round1: bool, rate: float | None = None
) -> dict[str, float]:
    """One variant's round; with ``rate`` (tokens/s) the scheduler submits at that pace instead of flat out."""
    dump_dir = scratch("hook-writer", shm=True)
    consumer = _Consumer(dump_dir)
    consumer.start()
    original = hook_writer.run_job
    if round1:
        hook_writer.run_job = _round1_run_job  # the loop looks the function up per job
    try:
        writer = hook_writer.DumpWriter(dump_dir, max_queue=4, threads=threads)
        jobs = _jobs(tokens, chunks, requests)
        blocked = 0.0
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        for n, job in enumerate(jobs):
            if rate is not None:  # the scheduler's pace: request n is ready at n * tokens / rate
                time.sleep(max(0.0, t0 + n * tokens / rate - time.perf_counter()))
            s = time.perf_counter()
            writer.submit(job)
            blocked += time.perf_counter() - s
        assert writer.flush(600) and writer.written == requests and writer.failed == 0
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    finally:
        hook_writer.run_job = original
        consumer.stop.set()
        consumer.join()
        rmtree(dump_dir)
    gb = tokens * requests * BYTES_PER_TOKEN / 1e9
    return {"GBps": gb / wall, "core_s_per_GB": cpu / gb, "submit_blocked_share": blocked / wall}


PACED_TOKENS_PER_S = (25_000, 50_000, 100_000)


def run_hook_writer(rounds: int = 5, tokens: int = 2048, chunks: int = 8, requests: int = 24) -> dict[str, Any]:
    variants: dict[str, Callable[[], dict[str, float]]] = {
        "round 1 writer (1 thread, torch.cat), 1 chunk": lambda: _one_round(1, 1, tokens, requests, True),
        f"round 1 writer (1 thread, torch.cat), {chunks} chunks": lambda: _one_round(
            1, chunks, tokens, requests, True
        ),
    }
    for threads in (1, 2, 4):
        for n in (1, chunks):
            variants[f"{threads} writer thread(s), {n} chunk(s)"] = functools.partial(
                _one_round, threads, n, tokens, requests, False
            )
    for rate in PACED_TOKENS_PER_S:  # a scheduler producing dumps at a given pace: how long is it blocked?
        variants[f"{DEFAULT_THREADS} writer threads, {chunks} chunks, paced at {rate // 1000}k tok/s"] = (
            functools.partial(_one_round, DEFAULT_THREADS, chunks, tokens, requests, False, float(rate))
        )
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(rounds):  # interleaved, so drift in the machine's load touches every variant alike
        for name, fn in variants.items():
            samples[name].append(fn())
    runs = {
        name: {k: statistics.median(s[k] for s in got) for k in got[0]} | {"rounds": len(got)}
        for name, got in samples.items()
    }
    for v in runs.values():
        v["tokens_per_s"] = v["GBps"] * 1e9 / BYTES_PER_TOKEN
    base1 = runs["round 1 writer (1 thread, torch.cat), 1 chunk"]
    basec = runs[f"round 1 writer (1 thread, torch.cat), {chunks} chunks"]
    ratios = {
        "1 thread / round 1, 1 chunk (GB/s)": runs["1 writer thread(s), 1 chunk(s)"]["GBps"] / base1["GBps"],
        f"1 thread / round 1, {chunks} chunks (GB/s)": runs[f"1 writer thread(s), {chunks} chunk(s)"]["GBps"]
        / basec["GBps"],
        "2 threads / 1 thread, 1 chunk (GB/s)": runs["2 writer thread(s), 1 chunk(s)"]["GBps"]
        / runs["1 writer thread(s), 1 chunk(s)"]["GBps"],
        f"{chunks} chunks / 1 chunk, 1 thread (GB/s)": runs[f"1 writer thread(s), {chunks} chunk(s)"]["GBps"]
        / runs["1 writer thread(s), 1 chunk(s)"]["GBps"],
    }
    result = {
        "what": "SGLang hook dump writers driven flat out on CPU into /dev/shm (no SGLang, no GPU staging)",
        "command": f"python -m bench.hook_writer --rounds {rounds} --tokens {tokens} --chunks {chunks}",
        "hidden": HIDDEN,
        "num_aux": NUM_AUX,
        "tokens_per_request": tokens,
        "requests_per_round": requests,
        "runs": runs,
        "ratios": ratios,
    }
    path = write_result("hook_writer", result)
    print(f"\nhook writer (H={HIDDEN}, {tokens}-token requests, medians of {rounds} rounds):")
    for name, v in runs.items():
        print(f"  {name:46} {v['GBps']:6.2f} GB/s {v['core_s_per_GB']:5.2f} core-s/GB "
              f"{v['tokens_per_s'] / 1e3:6.0f}k tok/s  submit blocked {v['submit_blocked_share']:.0%}")  # fmt: skip
    for name, value in ratios.items():
        print(f"  ratio {name:44} {value:.2f}")
    print(f"  written to {path}")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--requests", type=int, default=24)
    a = p.parse_args(argv)
    return run_hook_writer(a.rounds, a.tokens, a.chunks, a.requests)


if __name__ == "__main__":
    main()
