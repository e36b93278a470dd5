"""Memory ceilings under hostile input (issue 32), each measured against its bound in a process of its own:

    .venv/bin/python -m bench.hostile_memory [--parquet-mib 1024] [--cell-mib 100] [--shards 10000] [--workers 4]

1. **A Parquet dataset with one huge cell.** A ~1 GiB file of pre-tokenized rows (2048 ids each), one of which holds
   a 100 MB list of ids, read as the extractor reads a dataset (``iter_rows`` with its cap + ``read_samples``,
   maxLength 8192): the peak RSS it adds, against the same file without the huge cell. Bound: the huge cell costs
   at most 3x its size (its column chunk, the decoded row group and a batch may hold it at once; it is never made
   Python objects, which would be ~9x) and is refused ``too_long``; memory does not grow with the file (batches of at most 256 rows or
   64 MiB).
2. **A 10k-shard run read in 4 DataLoader workers.** ``HiddenStatesDataset`` over a local run of 10,000
   one-sample shards, iterated by a DataLoader with 4 worker processes: the pickled dataset each worker gets
   (bound: 256 bytes per shard, commit records without token counts or quarantine) and each worker's peak RSS
   above an idle worker's (bound: 64 MiB, what 10k slim commit records and the read buffers take).

3. **Scratch with a store 10x slower than extraction.** B1's pre-tokenized rows against the synthetic server into the
   null S3 sink, first at full speed (seconds per shard), then with every shard PUT held ``--slow-factor`` times
   that long: the most spool files (the pod's /scratch) open at once, with ``output.maxOpenShards`` at its
   default and unbounded (64). Bound: ``maxOpenShards`` files of at most a shard's target plus one sample each (the
   last sample may pass the target); ``tests/run/test_scratch_bound.py`` checks the same through a real S3 server.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import read_hwm, rmtree, scratch, write_result

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
MAX_LENGTH = 8192
CELL_FACTOR_BOUND = 3.0
PICKLED_BYTES_PER_SHARD_BOUND = 256
WORKER_RSS_BOUND = 64 * MIB


# ---- 1. Parquet -------------------------------------------------------------------------------
def write_parquet(path: Path, total_mib: int, cell_mib: int) -> int:
    """``total_mib`` of pre-tokenized rows (2048 ids and their mask, as int64 lists); with ``cell_mib`` one row in
    the middle holds a list of ids that many MiB long (the case that costs ~9x as Python ints)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hsx_extractor.tools.tinymodel import BOS, SPECIAL_TOKENS

    bos = SPECIAL_TOKENS.index(BOS)
    ids = [bos, *(40 + i % 400 for i in range(2047))]
    mask = [0, *([1] * 2047)]
    row_bytes = 2 * 8 * len(ids)
    rows = total_mib * MIB // row_bytes
    huge = rows // 2 if cell_mib else -1
    huge_ids = [bos, *([41] * (cell_mib * MIB // 8 - 1))]
    writer = None
    for start in range(0, rows, 1024):
        batch = [
            {"id": f"r{i}", "input_ids": huge_ids if i == huge else ids, "loss_mask": None if i == huge else mask}
            for i in range(start, min(start + 1024, rows))
        ]  # fmt: skip
        table = pa.Table.from_pylist(batch)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()
    return rows


def read_child(path: str, tokenizer: str) -> dict[str, Any]:
    """In the child: read the dataset as the extractor does; the RSS it added and what each row became."""
    from hsx_extractor.run.dataset import Rejected, read_samples
    from hsx_extractor.run.row_bounds import row_bytes_limit
    from hsx_extractor.run.sources import iter_rows
    from hsx_extractor.run.tokens import ChatTokenizer

    tok = ChatTokenizer(tokenizer)
    before = read_hwm(os.getpid())
    reasons: dict[str, int] = {}
    started = time.perf_counter()
    for item in read_samples(iter_rows(path, max_line=row_bytes_limit(MAX_LENGTH)), tok, MAX_LENGTH):
        key = str(item.reason) if isinstance(item, Rejected) else "sample"
        reasons[key] = reasons.get(key, 0) + 1
    return {"addedBytes": read_hwm(os.getpid()) - before, "baseBytes": before, "outcomes": reasons,
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


def run_child(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "bench.hostile_memory", "--child", *args], cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_parquet(total_mib: int, cell_mib: int) -> dict[str, Any]:
    from hsx_extractor.tools.tinymodel import build_tiny_model

    work = scratch("parquet")
    try:
        tokenizer = build_tiny_model(work / "tiny")
        files = {"huge": work / "huge.parquet", "control": work / "control.parquet"}
        write_parquet(files["huge"], total_mib, cell_mib)
        write_parquet(files["control"], total_mib, 0)
        got = {name: run_child("parquet", str(path), str(tokenizer)) for name, path in files.items()}
        got["fileBytes"] = {name: path.stat().st_size for name, path in files.items()}
    finally:
        rmtree(work)
    extra = got["huge"]["addedBytes"] - got["control"]["addedBytes"]
    factor = extra / (cell_mib * MIB)
    got["cellCostFactor"] = round(factor, 2)
    got["bound"] = f"the huge cell adds <= {CELL_FACTOR_BOUND}x its size; it is refused too_long"
    got["withinBound"] = factor <= CELL_FACTOR_BOUND and got["huge"]["outcomes"].get("too_long") == 1
    return got


# ---- 2. the reader of a 10k-shard run ----------------------------------------------------------
def write_many_shards(root: Path, shards: int) -> str:
    sys.path.insert(0, str(ROOT))
    from hsx_extractor.config import OutputSpec
    from hsx_extractor.storage.store import open_store
    from tests.storage.samples import finalize_run, plan_for, write_run

    store = open_store(OutputSpec.model_validate({"uri": str(root)}), "many")
    write_run(store, plan_for(shards, 1), hidden=32)
    finalize_run(store, {})
    return str(root / "many")


def loader_child(uri: str, workers: int) -> dict[str, Any]:
    """In the child: iterate the run in ``workers`` DataLoader workers; the pickled state and the workers' peaks."""
    import pickle
    import threading

    import torch.utils.data

    from hsx_extractor.reader import HiddenStatesDataset

    dataset = HiddenStatesDataset(uri)
    pickled = len(pickle.dumps(dataset))
    peaks: dict[int, int] = {}
    stop = threading.Event()

    def watch() -> None:
        me = str(os.getpid())
        while not stop.is_set():
            for entry in Path("/proc").iterdir():
                try:
                    if entry.name.isdigit() and (entry / "stat").read_text().split()[3] == me:
                        peaks[int(entry.name)] = max(peaks.get(int(entry.name), 0), read_hwm(int(entry.name)))
                except (OSError, IndexError):
                    continue
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    count = sum(1 for _ in loader)
    stop.set()
    watcher.join()
    return {"samples": count, "pickledBytes": pickled, "workerPeaks": sorted(peaks.values())}


def idle_worker_child(workers: int) -> dict[str, Any]:
    """The peak RSS of DataLoader workers that read nothing (torch and hsx imported): the baseline."""
    import torch.utils.data

    import hsx_extractor.reader  # noqa: F401  (what a reading worker imports)

    class Nothing(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return workers

        def __getitem__(self, i: int) -> int:
            return read_hwm(os.getpid())

    peaks = list(torch.utils.data.DataLoader(Nothing(), batch_size=None, num_workers=workers))
    return {"workerPeaks": [int(p) for p in peaks]}


def measure_reader(shards: int, workers: int) -> dict[str, Any]:
    work = scratch("reader")
    try:
        uri = write_many_shards(work, shards)
        got = run_child("loader", uri, str(workers))
        idle = run_child("idle", str(workers))
    finally:
        rmtree(work)
    per_shard = got["pickledBytes"] / shards
    extra = max(got["workerPeaks"][-workers:]) - max(idle["workerPeaks"])
    got.update({
        "shards": shards, "pickledBytesPerShard": round(per_shard, 1), "idleWorkerPeaks": idle["workerPeaks"],
        "workerExtraBytes": extra,
        "bound": f"pickled <= {PICKLED_BYTES_PER_SHARD_BOUND} B per shard; a worker <= {WORKER_RSS_BOUND >> 20} MiB "
                 "above an idle one",
        "withinBound": per_shard <= PICKLED_BYTES_PER_SHARD_BOUND and extra <= WORKER_RSS_BOUND,
    })  # fmt: skip
    return got


def measure_scratch(mib: int, shard_mib: int, factor: float) -> dict[str, Any]:
    import asyncio

    from bench.common import SpoolWatch
    from bench.extractor_cost import workload
    from hsx_extractor.config import ExtractConfig, OutputSpec
    from hsx_extractor.run.runner import extract

    default_open = OutputSpec.model_fields["maxOpenShards"].default

    def run(name: str, slow: float, max_open: int) -> dict[str, Any]:
        with workload(name, mib, False, slow_shards=slow) as w:
            cfg = w.config(name, w.rows, "none", shard_mib)
            cfg["output"]["maxOpenShards"] = max_open
            t0 = time.perf_counter()
            with SpoolWatch() as watch:
                code, result = asyncio.run(extract(ExtractConfig.model_validate(cfg)))
            wall = time.perf_counter() - t0
        if code != 0 or result is None or result.manifest is None:
            raise RuntimeError(f"{name}: hsx extract exited {code}")
        shards = len(result.manifest["shards"])
        return {"shards": shards, "wallSeconds": round(wall, 2), "secondsPerShard": round(wall / shards, 3),
                "peakSpoolFiles": watch.peak_files, "peakSpoolBytes": watch.peak_bytes}  # fmt: skip

    fast = run("scratch-fast", 0.0, default_open)
    slow = round(factor * fast["secondsPerShard"], 3)
    bounded, loose = run("scratch-bounded", slow, default_open), run("scratch-loose", slow, 64)
    from bench.b1_dataplane import NUM_AUX
    from bench.extractor_cost import HIDDEN

    largest_sample = 1536 * HIDDEN * (NUM_AUX + 1) * 2  # the workload's longest row: a shard may pass its target by one
    bound_bytes = default_open * ((shard_mib << 20) + largest_sample)
    return {
        "fast": fast, "slowShardPutSeconds": slow, "bounded": bounded, "unbounded": loose, "maxOpenShards": default_open,
        "bound": f"<= maxOpenShards ({default_open}) spool files and {bound_bytes >> 20} MiB",
        "withinBound": bounded["peakSpoolFiles"] <= default_open and bounded["peakSpoolBytes"] <= bound_bytes,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        kind, *rest = argv[1:]
        out = {
            "parquet": lambda: read_child(rest[0], rest[1]),
            "loader": lambda: loader_child(rest[0], int(rest[1])),
            "idle": lambda: idle_worker_child(int(rest[0])),
        }[kind]()
        print(json.dumps(out))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.hostile_memory", description=__doc__)
    p.add_argument("--parquet-mib", type=int, default=1024)
    p.add_argument("--cell-mib", type=int, default=100)
    p.add_argument("--shards", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--scratch-mib", type=int, default=768, help="hidden states of the scratch case")
    p.add_argument("--shard-mib", type=int, default=64)
    p.add_argument("--slow-factor", type=float, default=10.0)
    p.add_argument("--only", choices=("parquet", "reader", "scratch"), help="one case")
    args = p.parse_args(argv)
    cases = {
        "parquet": lambda: measure_parquet(args.parquet_mib, args.cell_mib),
        "reader": lambda: measure_reader(args.shards, args.workers),
        "scratch": lambda: measure_scratch(args.scratch_mib, args.shard_mib, args.slow_factor),
    }
    result = {name: case() for name, case in cases.items() if args.only in (None, name)}
    path = write_result("hostile_memory" if args.only is None else f"hostile_memory_{args.only}", result)
    for name, got in result.items():
        print(f"{name}: within bound: {got['withinBound']} ({got['bound']})")
    print(json.dumps(result, indent=1))
    print(f"-> {path}")
    return 0 if all(g["withinBound"] for g in result.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
