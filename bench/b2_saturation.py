"""B2, server saturation: how much of a fixed-capacity server the extractor keeps busy.

    .venv/bin/python -m bench.b2_saturation [--capacity 20000] [--samples 200]

``bench.synth_server --capacity C`` simulates an accelerator with C tokens/s: it batches every
request in flight, takes ``overhead + tokens / C`` seconds per batch and writes each request's
dump like the hook. Utilization is the server's busy time over the window from the first
request to the last answer; ``tokens / (C * window)`` is the share of raw capacity used. The
extractor at its default concurrency is measured against the same extractor sending one
request at a time (concurrency 1), in one run. Output goes to a local directory so the store's
speed (B1's subject) stays out of it.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from bench.b1_dataplane import run_extract
from bench.common import rmtree, scratch, synth_server, timed, token_rows, tokenizer_dir, write_result

SEED = 8202
TARGET = 0.95


def run_b2(capacity: float = 20000.0, samples: int = 200, sequential_samples: int = 40, hidden: int = 256,
           overhead_ms: float = 5.0) -> dict[str, Any]:
    from hsx_extractor.config import ExtractConfig

    default_concurrency = ExtractConfig.model_fields["concurrency"].default
    rng = np.random.default_rng(SEED)
    lengths = [int(n) for n in rng.integers(128, 2048, samples)]
    work = scratch("b2")
    dumps = scratch("b2-dumps", shm=True)
    results: dict[str, Any] = {"seed": SEED, "capacity_tokens_per_s": capacity, "batch_overhead_ms": overhead_ms,
                               "hidden": hidden, "target": TARGET}
    print(f"B2: capacity {capacity:,.0f} tok/s, {samples} samples of 128..2047 tokens, seed {SEED}", flush=True)
    try:
        tok = tokenizer_dir(work)
        dataset = token_rows(work / "rows.jsonl", lengths, SEED)
        extra = ["--capacity", str(capacity), "--batch-overhead-ms", str(overhead_ms)]
        with synth_server(dumps, hidden, max(lengths), *extra) as synth:
            runs = {}
            for name, concurrency, limit in (
                ("warm-up", 4, 4),
                (f"hsx extract, default concurrency {default_concurrency}", default_concurrency, samples),
                ("one request at a time", 1, sequential_samples),
            ):
                synth.reset()
                cfg = {
                    "runId": f"b2-c{concurrency}",
                    "dataset": {"uri": str(dataset), "format": "tokens", "tokenizer": str(tok),
                                "maxLength": 4096, "limit": limit},
                    "output": {"uri": str(work / "out"), "compression": "none", "shardTargetBytes": 64 << 20},
                    "serverUrl": synth.url,
                    "dumpDir": str(dumps),
                    "concurrency": concurrency,
                    "progressPort": 0,
                    "logIntervalSeconds": 3600,
                }
                wall, _, _ = timed(lambda c=cfg: run_extract(c))  # type: ignore[misc]
                stats = synth.stats()
                if name == "warm-up":
                    continue
                window = stats["windowSeconds"]
                runs[name] = {
                    "concurrency": concurrency, "samples": limit, "seconds": wall, **stats,
                    "capacity_used": stats["tokens"] / (capacity * window) if window else None,
                }
                print(f"  {name}: utilization {stats['utilization']:.3f}, mean batch "
                      f"{stats['meanBatchRequests']:.1f} requests", flush=True)
        results["runs"] = runs
    finally:
        rmtree(work)
        rmtree(dumps)
    print_b2(results)
    write_result("b2_saturation", results)
    return results


def print_b2(results: dict[str, Any]) -> None:
    print(f"\nB2 server saturation (capacity {results['capacity_tokens_per_s']:,.0f} tok/s):")
    print(f"  {'':44} {'busy':>6} {'capacity used':>14} {'mean batch':>11}")
    for name, r in results["runs"].items():
        print(f"  {name:44} {r['utilization']:6.3f} {r['capacity_used']:14.3f} {r['meanBatchRequests']:11.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--capacity", type=float, default=20000.0, help="simulated tokens/s")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--sequential-samples", type=int, default=40)
    args = p.parse_args(argv)
    run_b2(args.capacity, args.samples, args.sequential_samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
