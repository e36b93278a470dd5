"""Peak memory of ``hsx extract`` with 16 requests in flight of long samples at hidden 7168,
and whether shared-memory back-pressure (``dumpDirMaxBytes``) holds.

    .venv/bin/python -m bench.memory [--tokens 2048] [--samples 24] [--limit-mib 1024]

The issue asks for 8k-token samples; one such dump at H=7168 with 3 captured layers is
8192 * 4 * 7168 * 2 B = 470 MB, and 16 in flight would need ~7.5 GB of shared memory plus the
extractor's own copies, more than this 24 GiB, 2-core machine can spare while others work. The
default scales the sample length to 2048 tokens (117 MB per dump) and the shm limit with it;
``--tokens 8192`` runs the unscaled case. The extractor is a subprocess (``hsx extract``);
its VmHWM and the dump directory's size are sampled every 50 ms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import (
    PeakSampler,
    rmtree,
    scratch,
    synth_server,
    timed,
    token_rows,
    tokenizer_dir,
    write_result,
)

SEED = 8303
NUM_AUX = 3


def run_memory(tokens: int = 2048, samples: int = 24, limit_mib: int = 1024, hidden: int = 7168,
               concurrency: int = 16) -> dict[str, Any]:
    per_dump = tokens * (NUM_AUX + 1) * hidden * 2
    work = scratch("mem")
    dumps = scratch("mem-dumps", shm=True)
    limit = limit_mib << 20
    print(f"memory: {samples} samples x {tokens} tokens at H={hidden} ({per_dump / 1e6:,.0f} MB per dump), "
          f"concurrency {concurrency}, dumpDirMaxBytes {limit / 1e6:,.0f} MB", flush=True)
    try:
        tok = tokenizer_dir(work)
        dataset = token_rows(work / "rows.jsonl", [tokens] * samples, SEED)
        with synth_server(dumps, hidden, tokens) as synth:
            config = {
                "runId": "mem",
                "dataset": {"uri": str(dataset), "format": "tokens", "tokenizer": str(tok), "maxLength": tokens},
                "output": {"uri": str(work / "out"), "compression": "bf16-zstd", "shardTargetBytes": 1 << 30},
                "serverUrl": synth.url,
                "dumpDir": str(dumps),
                "dumpDirMaxBytes": limit,
                "concurrency": concurrency,
                "progressPort": 0,
                "logIntervalSeconds": 3600,
            }
            cfg_path = work / "config.json"
            cfg_path.write_text(json.dumps(config))
            hsx = str(Path(sys.executable).parent / "hsx")
            proc = subprocess.Popen([hsx, "extract", "--config", str(cfg_path)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            with PeakSampler(proc.pid, dumps) as peaks:
                wall, _, _ = timed(proc.wait)
                err = proc.stderr.read() if proc.stderr else ""
            server_stats = synth.stats()
        if proc.returncode != 0:
            raise RuntimeError(f"hsx extract exited {proc.returncode}: {err[-2000:]}")
        manifest = json.loads((work / "out" / "mem" / "manifest.json").read_text())
        if manifest["samples"] != samples:  # a benchmark of quarantined rows measures nothing
            raise RuntimeError(f"hsx extract stored {manifest['samples']} of {samples} samples: {err[-2000:]}")
        results = {
            "seed": SEED, "tokens_per_sample": tokens, "hidden": hidden, "num_aux": NUM_AUX, "samples": samples,
            "concurrency": concurrency, "bytes_per_dump": per_dump, "dump_dir_max_bytes": limit,
            "peak_rss_bytes": peaks.peak_rss, "peak_dump_dir_bytes": peaks.peak_dir_bytes,
            "server_max_in_flight": server_stats["maxInFlight"], "seconds": wall,
            "scaled_from": {"tokens_per_sample": 8192, "factor": 8192 / tokens} if tokens != 8192 else None,
        }
        results["peak_rss_in_dumps"] = peaks.peak_rss / per_dump
        # Strict: requests reserve their dump's room before they are sent, so shm never passes the limit.
        results["back_pressure_held"] = peaks.peak_dir_bytes <= limit
        results["dump_dir_peak_over_limit_in_dumps"] = (peaks.peak_dir_bytes - limit) / per_dump
    finally:
        rmtree(work)
        rmtree(dumps)
    print_memory(results)
    write_result("memory", results)
    return results


def print_memory(r: dict[str, Any]) -> None:
    print(f"\nmemory ({r['samples']} x {r['tokens_per_sample']} tokens, H={r['hidden']}, "
          f"{r['concurrency']} in flight):")
    print(f"  peak extractor RSS       {r['peak_rss_bytes'] / 2**30:6.2f} GiB "
          f"({r['peak_rss_in_dumps']:.1f} dumps of {r['bytes_per_dump'] / 2**20:,.0f} MiB)")
    print(f"  peak dump dir (shm)      {r['peak_dump_dir_bytes'] / 2**30:6.2f} GiB "
          f"(limit {r['dump_dir_max_bytes'] / 2**30:.2f} GiB; {r['dump_dir_peak_over_limit_in_dumps']:+.1f} dumps over)")
    print(f"  server max in flight     {r['server_max_in_flight']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--limit-mib", type=int, default=1024, help="dumpDirMaxBytes in MiB")
    args = p.parse_args(argv)
    run_memory(args.tokens, args.samples, args.limit_mib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
