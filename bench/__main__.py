"""``make bench``: every benchmark in one go, then a one-screen summary (results in bench/results/).

    .venv/bin/python -m bench [--only b1,b2,b3,b4,memory,hook_writer,tokenize,reader,first_request,extractor_cost,extractor_scaling,gil,s3_clients,workers,fleet_tail]
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from typing import Any


def _b3() -> dict[str, Any]:
    from bench import bench_compression

    return bench_compression.main([])


def benchmarks() -> dict[str, Callable[[], dict[str, Any]]]:
    from bench.b1_dataplane import run_b1
    from bench.b2_saturation import run_b2
    from bench.b4_operator import run_b4
    from bench.extractor_cost import run_core_scaling, run_extractor_cost
    from bench.first_request import run_first_request
    from bench.fleet_tail import run_fleet_tail
    from bench.gil import run_gil
    from bench.hook_writer import run_hook_writer
    from bench.memory import run_memory
    from bench.reader import main as run_reader
    from bench.s3_clients import run_s3_clients
    from bench.tokenize import run_tokenize
    from bench.workers import run_workers

    return {
        "b1": run_b1,
        "b2": run_b2,
        "b3": _b3,
        "b4": run_b4,
        "memory": run_memory,
        "hook_writer": run_hook_writer,
        "tokenize": run_tokenize,
        "reader": lambda: run_reader([]),
        "first_request": run_first_request,
        "extractor_cost": lambda: run_extractor_cost(mib=3072, tls=True, marginal=True, shard_mib=1024),
        "extractor_scaling": lambda: run_core_scaling(mib=2048, rounds=3, codec="bf16-zstd", pairs=2, shard_mib=1024),
        "gil": run_gil,
        "s3_clients": run_s3_clients,
        "workers": lambda: run_workers(mib=1024, pairs=3, shard_mib=128),
        "fleet_tail": lambda: run_fleet_tail(rows=400, rounds=3, members=4, slow=5.0),
    }


def summary(results: dict[str, Any]) -> list[str]:
    """The one-screen table (pure)."""
    lines = ["", "=" * 100, f"{'benchmark':14} {'figure':56} {'measured':>14} {'target':>12}", "-" * 100]

    def row(bench: str, figure: str, value: str, target: str = "") -> None:
        lines.append(f"{bench:14} {figure:56} {value:>14} {target:>12}")

    for name, r in results.items():
        if isinstance(r, Exception):
            row(name, f"FAILED: {type(r).__name__}: {str(r)[:40]}", "-")
            continue
        if name == "b1":
            runs, ratios = r["runs"], r["ratios"]
            for run in ("hsx extract (none)", "hsx extract (bf16-zstd)"):
                row("B1 data plane", f"{run} MB/s (per core)",
                    f"{runs[run]['MBps']:.0f} ({runs[run]['MBps_per_core']:.0f})")
                row("", f"  x ceiling (plain multipart {runs['ceiling: plain multipart']['MBps']:.0f} MB/s)",
                    f"{ratios[run]['vs_ceiling']:.2f}", ">= 0.85")
                row("", f"  x baseline (torch.save + seq. upload "
                        f"{runs['baseline: torch.save + sequential upload']['MBps']:.0f} MB/s)",
                    f"{ratios[run]['vs_baseline']:.2f}", ">= 3")
        elif name == "b2":
            for run, v in r["runs"].items():
                row("B2 saturation", f"{run}: server busy", f"{v['utilization']:.3f}",
                    ">= 0.95" if v["concurrency"] > 1 else "")
        elif name == "b3":
            for profile, methods in r["profiles"].items():
                for method, m in methods.items():
                    row("B3 compress", f"{profile[:24]} {method}: ratio, MB/s c/d",
                        f"{m['ratio']:.3f} {m['compress_MBps']:.0f}/{m['decompress_MBps']:.0f}")
        elif name == "b4":
            row("B4 operator", "apply -> Job p50 / p95 (one at a time)",
                f"{r['sequential_p50_s']:.2f}/{r['sequential_p95_s']:.2f}s")
            row("", f"apply -> Job p50 / p95 (burst of {r['total'] - r['sequential']})",
                f"{r['burst_p50_s']:.2f}/{r['burst_p95_s']:.2f}s")
            row("", f"{r['total']} reconciled, errors, duplicate Jobs",
                f"{r['reconciled_with_status']}, {r['operator_errors']}, {r['duplicate_jobs']}", "200, 0, 0")
            row("", "API requests kopf retried (recovered)", f"{r.get('api_request_retries', 0)}")
            row("", "operator peak RSS", f"{r['operator_peak_rss_bytes'] / 2**20:.0f} MiB")
        elif name == "memory":
            row("memory", f"peak RSS, {r['concurrency']} in flight x {r['tokens_per_sample']} tok, H={r['hidden']}",
                f"{r['peak_rss_bytes'] / 2**30:.2f} GiB")
            row("", f"peak shm vs dumpDirMaxBytes {r['dump_dir_max_bytes'] / 2**30:.2f} GiB",
                f"{r['peak_dump_dir_bytes'] / 2**30:.2f} GiB", "<= limit")
        elif name == "hook_writer":
            for run, v in r["runs"].items():
                row("hook writer", f"{run}: GB/s, core-s/GB",
                    f"{v['GBps']:.2f} {v['core_s_per_GB']:.2f}", "<= 0.6 c-s/GB")
                if "paced" in run:
                    row("", "  share of time the scheduler was blocked", f"{v['submit_blocked_share']:.0%}", "0%")
        elif name == "tokenize":
            low, high = r["server_tokens_per_s_assumed"]
            for case, c in r["cases"].items():
                hsx, plain = c["runs"][c["hsx_path"]], c["runs"]["plain apply_chat_template"]
                row("tokenize", f"{case.split()[0]} {c['hsx_path']}, {hsx['tokens_per_row']:.0f} tok/row: rows/s (tok/s)",
                    f"{hsx['rows_per_s']:.0f} ({hsx['tokens_per_s'] / 1000:.0f}k)")
                row("", f"  x plain apply_chat_template ({plain['rows_per_s']:.0f} rows/s)", f"{c['hsx_vs_plain']:.2f}")
                row("", f"  8-GPU server at {low // 1000}-{high // 1000}k tok/s: "
                        f"{c['server_8gpu']['low_rows_per_s']:.0f}-{c['server_8gpu']['high_rows_per_s']:.0f} rows/s, cores",
                    f"{c['cores_needed_at_high']:.2f}", "< 1")
        elif name == "first_request":
            row("first request", f"fresh run, {r['rows']} rows of {r['tokens_per_row']:.0f} tok: first request",
                f"{r['median_first_request_s']:.2f}s", "seconds")
            row("", "  the old pre-pass before it (x)",
                f"{r['median_pre_pass_s']:.0f}s ({r['pre_pass_over_first_request']:.0f}x)")
        elif name == "extractor_cost":
            for scheme in ("http", "https"):
                v = r[scheme]
                # Between commits inside a long run where measured (bench/extractor_cost.py), else 3x minus 1x.
                deep = v.get("window_core_s_per_gb", v["marginal_core_s_per_gb"])
                row("extractor", f"deep into a run, null sink over {scheme.upper()}: core-s/GB (MB/s)",
                    f"{deep:.2f} ({v['MBps']})", "<= 1.5")
            cores = " / ".join(str(c) for c in r["projected_cores_https"].values())
            row("", "  projected cores over HTTPS for 1 / 3 / 6 GB/s", cores)
        elif name == "extractor_scaling":
            rates = r["marginal_MBps"]
            row("extractor", f"1 -> 2 cores deep into a run ({rates['1 core']} -> {rates['2 cores']} MB/s, all on them)",
                f"x{r['scaling_1_to_2_cores']:.2f}", ">= 1.7")
        elif name == "gil":
            if "not_measured" in r:
                row("GIL", f"not measured: {r['not_measured']}", "-")
            else:
                row("GIL", "held by the extractor per GB deep into a run (on a CPU)",
                    f"{r['held_s_per_gb']:.2f}s ({r['held_on_cpu_s_per_gb']:.2f}s)")
                row("", "  one interpreter's ceiling (1 / GIL-s per GB)", f"{r['ceiling_GBps']:.1f} GB/s", ">= 3 GB/s")
        elif name == "workers":
            row("workers", "1 -> 2 extractor workers: throughput (core-s/GB)",
                f"x{r['throughput_2_over_1']:.2f} (x{r['core_s_per_gb_2_over_1']:.2f})")
            proj = r["projection_16_cores_https"]
            row("", f"  projected per 16-core pod over HTTPS, {proj['workers']} workers",
                f"{proj['GBps']:.1f} GB/s", ">= 7 GB/s")
        elif name == "fleet_tail":
            row("fleet tail", "leased fleet, one member 5x slower: wall / ideal", f"{r['leased_over_ideal']:.2f}",
                "<= 1.3")
            row("", "  static k % n split / leased", f"{r['static_over_leased']:.2f}")
        elif name == "s3_clients":
            for client, v in r["runs"].items():
                row("S3 client", f"{client}: core-s/GB (MB/s)", f"{v['core_s_per_gb']:.2f} ({v['MBps']})")
        elif name == "reader":
            for codec, per in r["codecs"].items():
                for setting, v in per.items():
                    if setting.startswith("workers="):
                        row("reader", f"{codec} {setting}: core-s/GB, GB/s wall",
                            f"{v['core_s_per_gb']:.2f} {v['gb_per_s_wall']:.2f}",
                            "<= 1.0 c-s/GB" if setting == "workers=0" else "")
    lines.append("=" * 100)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run hsx's benchmarks")
    p.add_argument("--only", default="b1,b2,b3,b4,memory,hook_writer,tokenize,reader,first_request,extractor_cost,extractor_scaling,gil,s3_clients", help="comma-separated subset")
    args = p.parse_args(argv)
    table = benchmarks()
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in table]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(table)}")
    results: dict[str, Any] = {}
    for name in wanted:
        print(f"\n### {name}", flush=True)
        try:
            results[name] = table[name]()
        except Exception as exc:  # one broken benchmark must not hide the others' numbers
            traceback.print_exc()
            results[name] = exc
    print("\n".join(summary(results)), flush=True)
    return 1 if any(isinstance(r, Exception) for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
