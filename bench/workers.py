"""Extractor workers per pod, 1 against 2 (issue 34 item 3): the same rows extracted by one ``hsx extract``
with ``workers: 1`` and with ``workers: 2`` (the supervisor and its two worker processes, each leasing its own
shards), alternating, and the projection for one 16-core pod.

    .venv/bin/python -m bench.workers [--mib 1024] [--pairs 3] [--shard-mib 128]

As bench/extractor_cost.py: B1's pre-tokenized rows against the synthetic server into the null S3 sink (both
other processes, not counted), so the CPU counted is the extractor's (supervisor and workers, RUSAGE_CHILDREN).
Each count runs twice, on ``--mib`` and on 3x ``--mib``: the difference is the cost deep into a run (each
worker's interpreter start-up and the run's planning cancel out), as bench/extractor_cost.py's marginal.
Reported: MB/s of hidden states and core-s per GB for each, medians over ``--pairs``; their ratios; and the
projection of one pod's GB/s over HTTPS at 16 cores from this machine's figures: cores / (HTTPS core-s per GB
(bench/results/extractor_cost_tls.json) x the measured 2-worker overhead), capped by the GIL (workers x 0.75 /
GIL-held s per GB, bench/results/gil.json). Results: bench/results/workers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_result
from bench.extractor_cost import workload

HSX = str(Path(sys.executable).parent / "hsx")
POD_CORES = 16
GIL_BUSY_AT_MOST = 0.75  # past this a worker's GIL queues its own threads (bench/gil.py)


def one_run(cfg: dict[str, Any], workers: int, work: Path, raw_bytes: int) -> dict[str, float]:
    """One ``hsx extract`` with ``workers`` processes: its MB/s and its processes' CPU per GB."""
    path = work / f"{cfg['runId']}.json"
    path.write_text(json.dumps(cfg | {"workers": workers}))
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([HSX, "extract", "--config", str(path)], capture_output=True, text=True, check=False)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"hsx extract (workers {workers}) exited {done.returncode}:\n{done.stderr[-3000:]}")
    gb = raw_bytes / 1e9
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"MBps": raw_bytes / wall / 1e6, "core_s_per_gb": cpu / gb, "wall_s": wall}


def stored(name: str, key: str, default: float) -> tuple[float, str]:
    """A figure from an earlier benchmark's result file, or ``default`` (said so) when it has not been run."""
    path = ROOT / "bench" / "results" / f"{name}.json"
    if not path.exists():
        return default, f"default {default} ({path.name} not run)"
    data = json.loads(path.read_text())
    value = data.get("https", {}).get(key) if name == "extractor_cost_tls" else data.get(key)
    return float(value), f"{path.name}: {key}"


def marginal(short: dict[str, float], long: dict[str, float], short_bytes: int, long_bytes: int) -> dict[str, float]:
    """Deep into a run: the long run less the short one (start-up, planning and the last commit cancel out)."""
    gb = (long_bytes - short_bytes) / 1e9
    cpu = long["core_s_per_gb"] * long_bytes / 1e9 - short["core_s_per_gb"] * short_bytes / 1e9
    return {"MBps": gb * 1e3 / (long["wall_s"] - short["wall_s"]), "core_s_per_gb": cpu / gb}


def run_workers(mib: int, pairs: int, shard_mib: int) -> dict[str, Any]:
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    deep: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    with workload("workers", mib, marginal=True) as w:
        assert w.long_rows is not None
        for p in range(pairs):
            for n in (1, 2):
                short = one_run(w.config(f"w{n}p{p}s", w.rows, "bf16-zstd", shard_mib), n, w.work, w.raw_bytes)
                long = one_run(w.config(f"w{n}p{p}l", w.long_rows, "bf16-zstd", shard_mib), n, w.work, w.long_raw_bytes)
                runs[n].append(long)
                deep[n].append(marginal(short, long, w.raw_bytes, w.long_raw_bytes))
                print(f"pair {p} workers {n}: whole run {long['MBps']:.0f} MB/s, {long['core_s_per_gb']:.2f} core-s/GB; "
                      f"deep into it {deep[n][-1]['MBps']:.0f} MB/s, {deep[n][-1]['core_s_per_gb']:.2f} core-s/GB",
                      flush=True)  # fmt: skip
        raw = w.long_raw_bytes
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("MBps", "core_s_per_gb")} for n, rs in deep.items()}
    whole = {n: {k: statistics.median(r[k] for r in rs) for k in ("MBps", "core_s_per_gb")} for n, rs in runs.items()}
    overhead = med[2]["core_s_per_gb"] / med[1]["core_s_per_gb"]
    https, https_src = stored("extractor_cost_tls", "window_core_s_per_gb", 1.57)
    gil, gil_src = stored("gil", "held_s_per_gb", 0.315)
    workers = POD_CORES // 4  # sizing.CORES_PER_WORKER
    cores_bound = POD_CORES / (https * overhead)
    gil_bound = workers * GIL_BUSY_AT_MOST / gil
    result: dict[str, Any] = {
        "what": "hsx extract with 1 and with 2 worker processes on the same rows (synthetic server, null sink)",
        "command": f"python -m bench.workers --mib {mib} --pairs {pairs} --shard-mib {shard_mib}",
        "raw_bytes": raw,
        "median_deep_into_the_run": {f"{n} worker{'s' if n > 1 else ''}": {k: round(v, 3) for k, v in m.items()}
                                     for n, m in med.items()},
        "median_whole_run": {f"{n} worker{'s' if n > 1 else ''}": {k: round(v, 3) for k, v in m.items()}
                             for n, m in whole.items()},
        "machine_cores": os.cpu_count(),
        "throughput_2_over_1": round(med[2]["MBps"] / med[1]["MBps"], 3),
        "core_s_per_gb_2_over_1": round(overhead, 3),
        "projection_16_cores_https": {
            "workers": workers,
            "https_core_s_per_gb": https, "from": https_src,
            "gil_held_s_per_gb": gil, "gil_from": gil_src,
            "cores_bound_GBps": round(cores_bound, 2),
            "gil_bound_GBps": round(gil_bound, 2),
            "GBps": round(min(cores_bound, gil_bound), 2),
        },
        "runs": {str(n): rs for n, rs in runs.items()},
        "deep": {str(n): rs for n, rs in deep.items()},
    }
    write_result("workers", result)
    proj = result["projection_16_cores_https"]
    print(f"workers 1 -> 2: throughput x{result['throughput_2_over_1']:.2f}, core-s/GB x{overhead:.2f}; "
          f"projected {proj['GBps']} GB/s per 16-core pod over HTTPS with {workers} workers "
          f"(cores bound {proj['cores_bound_GBps']}, GIL bound {proj['gil_bound_GBps']})", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--shard-mib", type=int, default=128)
    args = ap.parse_args(argv)
    run_workers(args.mib, args.pairs, args.shard_mib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
