"""The trainer's side: HiddenStatesDataset reading a committed run, per core and across DataLoader workers.

    .venv/bin/python -m bench.reader [--samples 8] [--seq-len 1024] [--hidden 7168] [--rounds 3] [--workers 2]

Writes one local run per codec (activation-like bf16 data as bench_compression makes it, H=7168, 3 aux
layers), then reads every sample as a trainer does (``dataset[i]``: ranged read, checksum, decode, torch
tensors) and reports CPU seconds per GB of raw hidden states (the issue's target: decode >= 1 GB/s per core,
i.e. <= 1.0 core-s/GB) and the wall-clock rate with 1..N DataLoader workers (worker CPU included).
The baseline in the same run is the raw codec (read + checksum + tensors, no decode). Medians of
``--rounds``; every round in bench/results/reader.json.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extractor"))
from bench.bench_compression import activation_like
from bench.common import rmtree, scratch, write_result
from hsx_extractor.config import OutputSpec
from hsx_extractor.reader import HiddenStatesDataset
from hsx_extractor.storage.shard_format import SampleRecord
from hsx_extractor.storage.store import open_store

NUM_AUX = 3
CAPTURE = {
    "engine": "hsx-bench",
    "engineVersion": "0",
    "layerIds": [2, 4, 5],
    "layerConvention": "layer-input",
    "finalState": "post-norm",
    "dtype": "bfloat16",
}


def write_run(
    root: Path, compression: str, samples: int, seq_len: int, hidden: int, final_state: str = "post-norm"
) -> tuple[str, int]:
    """A finished run of ``samples`` samples in shards of 4; returns (run uri, raw bytes of states)."""
    store = open_store(OutputSpec.model_validate({"uri": str(root), "compression": compression}), "bench")
    rng = np.random.default_rng(7)
    planned = [(k, s, min(s + 4, samples)) for k, s in enumerate(range(0, samples, 4))]
    store.put_json_if_absent("plan.json", {"shards": [{"index": k, "start": a, "stop": b} for k, a, b in planned]})
    for k, start, stop in planned:
        builder = store.open_shard(k, range(start, stop))
        for i in range(start, stop):
            states = activation_like(rng, seq_len, (NUM_AUX + 1) * hidden, 1.0, True)
            builder.add(
                SampleRecord(
                    index=i,
                    sample_id=f"s{i}",
                    input_ids=rng.integers(0, 150000, seq_len, dtype=np.int32),
                    loss_mask=(rng.random(seq_len) < 0.5).astype(np.uint8),
                    aux_hidden_states=np.ascontiguousarray(states[:, : NUM_AUX * hidden]),
                    hidden_states=np.ascontiguousarray(states[:, NUM_AUX * hidden :]),
                )
            )
        builder.seal()
    store.finalize(planned, {"run": {}, "capture": CAPTURE | {"finalState": final_state}})
    store.close()
    return f"{root}/bench", samples * seq_len * (NUM_AUX + 1) * hidden * 2


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def read_all(uri: str, workers: int) -> tuple[float, float]:
    """(wall s, CPU s of this process and its exited workers) to read every sample once."""
    import torch.utils.data

    dataset = HiddenStatesDataset(uri)
    cpu0 = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    if workers == 0:
        for i in range(len(dataset)):
            dataset[i]
    else:
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=workers, persistent_workers=False, multiprocessing_context="fork"
        )
        for _ in loader:
            pass
        del loader  # workers exit: their CPU is in RUSAGE_CHILDREN
    wall = time.perf_counter() - t0
    return wall, _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN) - cpu0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    root = scratch("reader")
    results: dict[str, Any] = {"args": vars(args), "codecs": {}}
    try:
        runs = {c: write_run(root / c, c, args.samples, args.seq_len, args.hidden) for c in ("none", "bf16-zstd")}
        for codec, (uri, raw) in runs.items():
            gb = raw / 1e9
            per: dict[str, Any] = {"raw_bytes": raw}
            rounds: dict[str, list[tuple[float, float]]] = {}
            for _ in range(args.rounds):  # interleaved: each setting sees the same machine state
                for workers in range(args.workers + 1):
                    rounds.setdefault(str(workers), []).append(read_all(uri, workers))
            for workers, got in rounds.items():
                wall = statistics.median(w for w, _ in got)
                cpu = statistics.median(c for _, c in got)
                per[f"workers={workers}"] = {
                    "rounds": got,
                    "core_s_per_gb": round(cpu / gb, 3),
                    "gb_per_s_per_core": round(gb / cpu, 3),
                    "gb_per_s_wall": round(gb / wall, 3),
                }
                print(
                    f"{codec:10s} workers={workers}: {cpu / gb:.3f} core-s/GB ({gb / cpu:.2f} GB/s per core), "
                    f"{gb / wall:.2f} GB/s wall",
                    flush=True,
                )
            results["codecs"][codec] = per
        base = results["codecs"]["none"]["workers=0"]["core_s_per_gb"]
        zstd = results["codecs"]["bf16-zstd"]["workers=0"]["core_s_per_gb"]
        results["decode_core_s_per_gb_over_raw_read"] = round(zstd - base, 3)
        print(f"bf16-zstd costs {zstd - base:.3f} core-s/GB more than reading the raw codec", flush=True)
    finally:
        rmtree(root)
    path = write_result("reader", results)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
