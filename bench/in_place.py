"""Training from the run in place against from a copied export (issue 35 item 5): samples/s and core-s per GB
through each trainer's own loader, both in one run, rounds interleaved; and what the copy costs first.

    .venv/bin/python -m bench.in_place [--samples 32] [--seq-len 1024] [--hidden 2048] [--rounds 3]

One local run per final-state convention (bench/reader.py's activation-like bf16, bf16-zstd, 3 aux layers):
post-norm for SpecForge and Model-Optimizer, pre-norm for speculators. For each trainer: ``hsx export`` (the
copy: its seconds and bytes written) and ``hsx export --in-place`` (launch files, speculators' row table),
then bench/trainer_read.py in the trainers venv reads every sample through the trainer's loader from each
(SpecForge: its offline reader, feature store and normaliser; speculators: ``ArrowDataset``; Model-Optimizer:
``OfflineSupervisedDataset`` against hsx's ``OfflineDataset``). The copy is read from files the export has
just written (the page cache); the in-place side reads and decodes the run's shards, checksums included.
Medians of ``--rounds``; results in bench/results/in_place.json.
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

from bench.common import ROOT, rmtree, scratch, write_result
from bench.reader import write_run
from tests.trainers.trainers_venv import is_built, venv_python

HSX = str(Path(sys.executable).parent / "hsx")
CONVENTION = {"specforge": "post-norm", "modelopt": "post-norm", "speculators": "pre-norm"}


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def export(run: str, trainer: str, dest: Path, gb: float, *extra: str) -> dict[str, Any]:
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    # The launch files need a target model's path; only the data path in them is read here.
    argv = [HSX, "export", "--to", trainer, "--target-model", "/models/target", *extra, run, str(dest)]
    subprocess.run(argv, check=True, capture_output=True)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return {"export_seconds": round(wall, 2), "export_core_s_per_gb": round(cpu / gb, 2), "bytes_written": tree_bytes(dest)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not is_built():
        raise SystemExit("the trainers venv is not built: bash tests/trainers/build_trainers.sh")
    root = scratch("in_place")
    results: dict[str, Any] = {"args": vars(args), "trainers": {}}
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "extractor")}
    env |= {k: v for k, v in os.environ.items() if k == "HSX_NATIVE_LIB"}
    try:
        runs = {
            state: write_run(root / state, "bf16-zstd", args.samples, args.seq_len, args.hidden, state)
            for state in sorted(set(CONVENTION.values()))
        }
        for trainer, state in CONVENTION.items():
            uri, raw = runs[state]
            copied, in_place = root / f"{trainer}-copied", root / f"{trainer}-in-place"
            gb = raw / 1e9
            made = {"copied": export(uri, trainer, copied, gb), "in_place": export(uri, trainer, in_place, gb, "--in-place")}
            done = subprocess.run(
                [str(venv_python()), "-P", str(ROOT / "bench" / "trainer_read.py"), trainer, str(copied), str(in_place),
                 str(args.rounds)], capture_output=True, text=True, env=env, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"{trainer}: trainer_read.py exited {done.returncode}:\n{done.stderr[-4000:]}")
            rounds = json.loads(done.stdout.strip().splitlines()[-1])
            per: dict[str, Any] = {"raw_state_bytes": raw, "run_bytes": tree_bytes(Path(uri))}
            for name, got in rounds.items():
                wall = statistics.median(w for w, _, _ in got)
                cpu = statistics.median(c for _, c, _ in got)
                per[name] = {**made[name], "rounds": got, "samples_per_s": round(got[0][2] / wall, 1),
                             "core_s_per_gb": round(cpu / gb, 3)}  # fmt: skip
            per["in_place_over_copied_samples_per_s"] = round(
                per["in_place"]["samples_per_s"] / per["copied"]["samples_per_s"], 2
            )
            results["trainers"][trainer] = per
            print(
                f"{trainer:12s} copied: {per['copied']['samples_per_s']} samples/s, "
                f"{per['copied']['core_s_per_gb']} core-s/GB read (export first: {made['copied']['export_seconds']} s, "
                f"{made['copied']['export_core_s_per_gb']} core-s/GB, {made['copied']['bytes_written'] / 1e6:.0f} MB "
                f"written) | in place: {per['in_place']['samples_per_s']} samples/s, "
                f"{per['in_place']['core_s_per_gb']} core-s/GB read ({made['in_place']['bytes_written'] / 1e3:.0f} kB "
                f"written) | x{per['in_place_over_copied_samples_per_s']}",
                flush=True,
            )
    finally:
        rmtree(root)
    path = write_result("in_place", results)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
