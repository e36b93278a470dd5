"""The extractor's own CPU per GB of hidden states, end to end, in steady state; optionally against another
checkout of hsx side by side (A/B of a change).

    .venv/bin/python -m bench.extractor_cost [--mib 1024] [--rounds 4] [--codec bf16-zstd] [--against DIR|numpy | --tls]
        [--pairs 2] [--marginal]

One process runs ``--rounds`` real ``hsx extract`` runs (run.runner.extract) of the same pre-tokenized
dataset (H=4096, 3 aux layers, 768-1536 tokens per sample, as B1) against the synthetic server, into the
null S3 sink (bench/null_s3.py), so the CPU counted is the extractor's alone (the server and the sink are
other processes). The first round warms what a long run keeps (spool files, part and plane buffers) and is
reported apart; the figure is the median of the others, user and system time apart.

``--against DIR`` runs the same measurement with the hsx checkout in DIR (a ``git worktree`` of another
commit) in its own process, ``--pairs`` times, alternating with this checkout: both see the same machine
state, so the difference is the change's; ``--against numpy`` runs this checkout without its native kernels
(HSX_NATIVE_LIB=off) instead. ``--tls`` instead runs this checkout against the sink over HTTP
and over HTTPS, alternating (bench/results/extractor_cost_tls.json), and projects the cores a pod needs at
1, 3 and 6 GB/s over HTTPS from the HTTPS figure. ``--core-scaling`` instead measures the throughput deep
into a run with every process on one CPU and on two, alternating (bench/results/extractor_scaling.json).

Deep into a run is measured two ways (``--marginal``): a run of 3x the rows minus a run of the rows (which
also counts what differs between the two runs' starts and ends, e.g. buffers sized for a smaller last shard),
and the CPU between two commits inside the long run, past its warm-up and before its tail (``window``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT

RESULT = "EXTRACTOR_COST "
B1_SHARD_MIB = 128  # B1's shards (the product's default shardTargetBytes is 1 GiB)
HIDDEN = 4096


@dataclass(frozen=True)
class Workload:
    """B1's pre-tokenized rows (and, for a marginal measure, rows 3x as long that start with the same rows),
    the synthetic server and the null S3 sink: what bench/extractor_cost.py and bench/gil.py run hsx extract on."""

    rows: Path
    long_rows: Path | None
    raw_bytes: int
    long_raw_bytes: int
    tokenizer: Path
    server_url: str
    dumps: Path
    sink: str
    work: Path  # scratch space, removed with the rest

    def config(self, run_id: str, rows: Path, codec: str, shard_mib: int) -> dict[str, Any]:
        from bench.b1_dataplane import extract_config

        return extract_config(run_id, rows, self.tokenizer, self.server_url, self.dumps, self.sink, "null", codec,
                              shard_mib << 20)


@contextlib.contextmanager
def workload(name: str, mib: int, marginal: bool, tls: bool = False, slow_shards: float = 0.0) -> Iterator[Workload]:
    """Rows of ``mib`` MiB of hidden states (H=4096, 3 aux layers, 768-1536 tokens per sample, as B1), served
    and sunk by local processes, removed on exit. With ``tls`` the sink serves HTTPS (a throwaway CA's
    certificate, which the extractor trusts through AWS_CA_BUNDLE)."""
    from bench.b1_dataplane import NUM_AUX, SEED, sample_lengths
    from bench.common import (
        null_sink,
        raw_bytes,
        rmtree,
        scratch,
        synth_server,
        tls_files,
        token_rows,
        tokenizer_dir,
    )

    work, dumps = scratch(name), scratch(f"{name}-dumps", shm=True)
    lengths = sample_lengths(mib << 20, HIDDEN, 768, 1536, SEED)
    long_lengths = sample_lengths(3 * mib << 20, HIDDEN, 768, 1536, SEED)  # the same rng: the same first rows
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
    try:
        tok = tokenizer_dir(work)
        rows = token_rows(work / "rows.jsonl", lengths, SEED)
        long_rows = token_rows(work / "long.jsonl", long_lengths, SEED) if marginal else None
        certs = tls_files(work) if tls else None
        if certs is not None:
            os.environ["AWS_CA_BUNDLE"] = str(certs.ca)
        with synth_server(dumps, HIDDEN, 1536) as synth, null_sink(certs, slow_shards) as sink:
            yield Workload(rows, long_rows, raw_bytes(lengths, HIDDEN, NUM_AUX), raw_bytes(long_lengths, HIDDEN, NUM_AUX),
                           tok, synth.url, dumps, sink, work)
    finally:
        rmtree(work)
        rmtree(dumps)


@dataclass(frozen=True)
class _Seal:
    at: float  # perf_counter
    usage: resource.struct_rusage
    bytes_raw: int


@contextlib.contextmanager
def _seal_clock() -> Iterator[list[_Seal]]:
    """This process's CPU time whenever a shard is committed (ShardBuilder.seal returns), in the order
    they were committed."""
    from hsx_extractor.storage.store import ShardBuilder

    seals: list[_Seal] = []
    lock = threading.Lock()
    original = ShardBuilder.seal

    def seal(self: Any, *args: Any, **kwargs: Any) -> Any:
        commit = original(self, *args, **kwargs)
        with lock:
            seals.append(_Seal(time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), commit.bytes_raw))
        return commit

    ShardBuilder.seal = seal  # type: ignore[method-assign]
    try:
        yield seals
    finally:
        ShardBuilder.seal = original  # type: ignore[method-assign]


WINDOW_SKIP = (2, 2)  # commits left out of the window at its start (warm-up) and end (the run's tail)


def _window(seals: list[_Seal]) -> dict[str, float] | None:
    """CPU per GB between two commits well inside one run: from the end of the warm-up (fresh spool files,
    part and plane buffers, thread start-up) to before the tail (where encoding has ended and only uploads
    remain). A shard is committed about one shard after its samples were encoded, in the window's first
    commit as in its last, so the window holds the work of the shards committed in it. None when the run had
    too few shards."""
    first, last = WINDOW_SKIP[0] - 1, len(seals) - 1 - WINDOW_SKIP[1]
    if last <= first:
        return None
    a, b = seals[first], seals[last]
    gb = sum(s.bytes_raw for s in seals[first + 1 : last + 1]) / 1e9
    return {
        "user": (b.usage.ru_utime - a.usage.ru_utime) / gb,
        "sys": (b.usage.ru_stime - a.usage.ru_stime) / gb,
        "MBps": gb * 1e3 / (b.at - a.at),
        "shards": last - first,
    }


def _rusage_round(cfg: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """One run's CPU (user, system: seconds per GB of raw states) and rate, and (``window``) the same between
    two commits inside the run (:func:`_window`)."""
    from bench.b1_dataplane import run_extract

    with _seal_clock() as seals:
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        run_extract(cfg)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    gb = nbytes / 1e9
    return {
        "user": (after.ru_utime - before.ru_utime) / gb,
        "sys": (after.ru_stime - before.ru_stime) / gb,
        "MBps": nbytes / wall / 1e6,
        "window": _window(sorted(seals, key=lambda s: s.at)),
    }


def measure(
    mib: int, rounds: int, codec: str, tls: bool = False, marginal: bool = False, shard_mib: int = B1_SHARD_MIB
) -> dict[str, Any]:
    """``rounds`` extractions in this process (the checkout this module was imported from); with ``tls``
    the sink serves HTTPS (a throwaway CA's certificate, which the extractor trusts through AWS_CA_BUNDLE). With
    ``marginal`` each round after the first also runs a dataset 3x as long that starts with the same rows:
    the difference between the two runs is the cost of the extra 2x, without what every run pays once
    (start-up, fresh threads and their buffers), i.e. the cost per GB deep into a long run; and the long run's
    own cost between two commits inside it (:func:`_window`, when it has enough shards), which does not count
    what differs between the two runs' starts and ends. ``shard_mib`` is the shards' target size (B1's by
    default)."""
    out: list[dict[str, Any]] = []
    margins: list[dict[str, float]] = []
    windows: list[dict[str, float]] = []
    with workload("cost", mib, marginal, tls) as w:
        nbytes, long_nbytes = w.raw_bytes, w.long_raw_bytes
        for r in range(rounds):
            out.append(_rusage_round(w.config(f"c{r}", w.rows, codec, shard_mib), nbytes))
            if w.long_rows is not None and r > 0:
                long = _rusage_round(w.config(f"l{r}", w.long_rows, codec, shard_mib), long_nbytes)
                if long["window"] is not None:
                    windows.append(long["window"])
                extra = (long_nbytes - nbytes) / 1e9
                margins.append({
                    k: (long[k] * long_nbytes / 1e9 - out[-1][k] * nbytes / 1e9) / extra for k in ("user", "sys")
                } | {"MBps": (long_nbytes - nbytes) / (long_nbytes / long["MBps"] - nbytes / out[-1]["MBps"])})
    steady = out[1:] or out
    total = [r["user"] + r["sys"] for r in steady]
    result: dict[str, Any] = {
        "raw_bytes": nbytes,
        "rounds": out,
        "first_round_core_s_per_gb": round(out[0]["user"] + out[0]["sys"], 3),
        "core_s_per_gb": round(statistics.median(total), 3),
        "user_core_s_per_gb": round(statistics.median(r["user"] for r in steady), 3),
        "sys_core_s_per_gb": round(statistics.median(r["sys"] for r in steady), 3),
        "MBps": round(statistics.median(r["MBps"] for r in steady)),
    }
    if margins:
        result |= _medians("marginal", margins)
    if windows:
        result |= _medians("window", windows)
    return result


def _medians(measure_: str, rounds: list[dict[str, float]]) -> dict[str, Any]:
    """A deep-into-a-run measure's rounds and their medians (core-s/GB in all, user, system; MB/s)."""
    return {
        f"{measure_}_rounds": rounds,
        f"{measure_}_core_s_per_gb": round(statistics.median(m["user"] + m["sys"] for m in rounds), 3),
        f"{measure_}_user_core_s_per_gb": round(statistics.median(m["user"] for m in rounds), 3),
        f"{measure_}_sys_core_s_per_gb": round(statistics.median(m["sys"] for m in rounds), 3),
        f"{measure_}_MBps": round(statistics.median(m["MBps"] for m in rounds)),
    }


def in_process(
    checkout: Path, mib: int, rounds: int, codec: str, tls: bool = False, marginal: bool = False,
    shard_mib: int = B1_SHARD_MIB, env: dict[str, str] | None = None, cpus: set[int] | None = None,
) -> dict[str, Any]:
    """:func:`measure` in a fresh process importing hsx_extractor from ``checkout`` (the benchmark's own
    helpers stay this checkout's), with ``env`` added to its environment; with ``cpus`` it and every
    process it starts (the synthetic server, the sink) run on those CPUs only."""
    code = (f"import json, sys; sys.path[:0] = [{str(ROOT)!r}, {str(checkout / 'extractor')!r}]; "
            f"from bench.extractor_cost import measure, RESULT; import hsx_extractor; "
            f"assert hsx_extractor.__file__.startswith({str(checkout)!r}), hsx_extractor.__file__; "
            f"print(RESULT + json.dumps(measure({mib}, {rounds}, {codec!r}, {tls!r}, {marginal!r}, {shard_mib})), flush=True)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
                          env=os.environ | (env or {}),
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measuring {checkout} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])  # type: ignore[no-any-return]


PROJECTED_GBPS = (1, 3, 6)
NUMPY = "numpy"  # --against numpy


def _summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {"raw_bytes": rs[0]["raw_bytes"],
           "core_s_per_gb": round(statistics.median(r["core_s_per_gb"] for r in rs), 3),
           "MBps": round(statistics.median(r["MBps"] for r in rs)), "processes": rs}
    for measure_ in ("marginal", "window"):
        if all(f"{measure_}_core_s_per_gb" in r for r in rs):
            for k in ("core_s_per_gb", "user_core_s_per_gb", "sys_core_s_per_gb"):
                out[f"{measure_}_{k}"] = round(statistics.median(r[f"{measure_}_{k}"] for r in rs), 3)
    return out


def run_extractor_cost(mib: int = 1024, rounds: int = 4, codec: str = "bf16-zstd", against: str | None = None,
                       pairs: int = 2, tls: bool = False, marginal: bool = False,
                       shard_mib: int = B1_SHARD_MIB) -> dict[str, Any]:
    """``against``: another checkout's directory, or ``numpy``: this checkout without its native kernels
    (HSX_NATIVE_LIB=off, storage/native.py)."""
    from bench.common import write_result

    # Here, not at the top: the child that measures another checkout imports this module first, and a
    # checkout from before the native kernels has no storage.native.
    from hsx_extractor.storage.native import LIBRARY_ENV, LIBRARY_OFF

    result: dict[str, Any] = {
        "what": "hsx extract's own CPU per GB of hidden states into the null S3 sink, steady state",
        "command": f"python -m bench.extractor_cost --mib {mib} --rounds {rounds} --codec {codec}"
                   + (f" --against {against} --pairs {pairs}" if against else "")
                   + (f" --tls --pairs {pairs}" if tls else "") + (" --marginal" if marginal else "")
                   + (f" --shard-mib {shard_mib}" if shard_mib != B1_SHARD_MIB else ""),
        "codec": codec,
    }
    if tls:
        # The same checkout over HTTP and HTTPS, alternating: the difference is the TLS client's cost.
        runs: dict[str, list[dict[str, Any]]] = {"http": [], "https": []}
        for _ in range(pairs):
            runs["http"].append(in_process(ROOT, mib, rounds, codec, marginal=marginal, shard_mib=shard_mib))
            runs["https"].append(in_process(ROOT, mib, rounds, codec, tls=True, marginal=marginal, shard_mib=shard_mib))
        result |= {name: _summary(rs) for name, rs in runs.items()}
        result["https_over_http"] = round(result["https"]["core_s_per_gb"] / result["http"]["core_s_per_gb"], 3)
        https = result["https"]
        per_gb = https.get("window_core_s_per_gb", https.get("marginal_core_s_per_gb", https["core_s_per_gb"]))
        result["projected_cores_https"] = {f"{gbps} GB/s": round(gbps * per_gb, 1) for gbps in PROJECTED_GBPS}
    elif against is None:
        result["this"] = in_process(ROOT, mib, rounds, codec, marginal=marginal, shard_mib=shard_mib)
    else:
        runs = {"this": [], "against": []}
        numpy_only = against == NUMPY
        other = ROOT if numpy_only else Path(against).resolve()
        for _ in range(pairs):
            runs["against"].append(in_process(other, mib, rounds, codec, marginal=marginal, shard_mib=shard_mib,
                                              env={LIBRARY_ENV: LIBRARY_OFF} if numpy_only else None))
            runs["this"].append(in_process(ROOT, mib, rounds, codec, marginal=marginal, shard_mib=shard_mib))
        result |= {name: _summary(rs) for name, rs in runs.items()}
        result["against_checkout"] = f"{ROOT} with {LIBRARY_ENV}={LIBRARY_OFF}" if numpy_only else str(other)
        result["this_over_against"] = round(result["this"]["core_s_per_gb"] / result["against"]["core_s_per_gb"], 3)
    write_result("extractor_cost" + ("_tls" if tls else ""), result)
    for name in ("this", "against", "http", "https"):
        if name in result:
            r = result[name]
            deep = f", {r['marginal_core_s_per_gb']:.2f} deep into a run" if "marginal_core_s_per_gb" in r else ""
            if "window_core_s_per_gb" in r:
                deep += (f" ({r['window_core_s_per_gb']:.2f} between commits inside the long run: user "
                         f"{r['window_user_core_s_per_gb']:.2f}, system {r['window_sys_core_s_per_gb']:.2f})")
            print(f"{name:8} {r['core_s_per_gb']:.2f} core-s/GB per run{deep}, {r['MBps']} MB/s", flush=True)
    if tls:
        cores = ", ".join(f"{k}: {v} cores" for k, v in result["projected_cores_https"].items())
        print(f"projected over HTTPS (at this machine's per-core speed): {cores}", flush=True)
    return result


def run_core_scaling(mib: int, rounds: int, codec: str, pairs: int, shard_mib: int) -> dict[str, Any]:
    """Deep-into-a-run throughput with everything (extractor, synthetic server, sink) on one CPU, then on
    two, alternating ``pairs`` times: the pipeline's 1 -> 2-core scaling on this machine. The server and the
    sink share the cores, so it bounds the extractor's own scaling from below."""
    from bench.common import write_result

    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("core scaling needs 2 CPUs")
    two = set(sorted(os.sched_getaffinity(0))[:2])
    runs: dict[str, list[dict[str, Any]]] = {"1 core": [], "2 cores": []}
    for _ in range(pairs):
        for name, cpus in (("1 core", {min(two)}), ("2 cores", two)):
            runs[name].append(in_process(ROOT, mib, rounds, codec, marginal=True, shard_mib=shard_mib, cpus=cpus))
    rate = {name: statistics.median(r["marginal_MBps"] for r in rs) for name, rs in runs.items()}
    result: dict[str, Any] = {
        "what": "hsx extract's throughput deep into a run on 1 and on 2 CPUs (with the synthetic server and the "
                "null sink on the same CPUs)",
        "command": f"python -m bench.extractor_cost --core-scaling --mib {mib} --rounds {rounds} --codec {codec} "
                   f"--pairs {pairs} --shard-mib {shard_mib}",
        "codec": codec,
        "marginal_MBps": {name: round(v) for name, v in rate.items()},
        "scaling_1_to_2_cores": round(rate["2 cores"] / rate["1 core"], 3),
        "runs": runs,
    }
    write_result("extractor_scaling", result)
    print(f"deep into a run: {rate['1 core']:.0f} MB/s on 1 core, {rate['2 cores']:.0f} on 2: "
          f"x{result['scaling_1_to_2_cores']:.2f}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--codec", default="bf16-zstd", choices=["none", "bf16-zstd", "fp8-e4m3"])
    ap.add_argument("--against", help="another hsx checkout (a git worktree) to measure side by side, or "
                    f"'{NUMPY}': this checkout without its native kernels")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--tls", action="store_true", help="measure over HTTP and HTTPS side by side instead")
    ap.add_argument("--marginal", action="store_true", help="also the cost per GB deep into a run (3x the bytes)")
    ap.add_argument("--shard-mib", type=int, default=B1_SHARD_MIB,
                    help="shardTargetBytes in MiB (B1's 128; the product's default is 1024)")
    ap.add_argument("--core-scaling", action="store_true",
                    help="instead: throughput deep into a run on 1 CPU and on 2 (bench/results/extractor_scaling.json)")
    args = ap.parse_args(argv)
    if args.core_scaling:
        run_core_scaling(args.mib, args.rounds, args.codec, args.pairs, args.shard_mib)
        return 0
    if args.tls and args.against:
        ap.error("--tls and --against measure different things: give one")
    run_extractor_cost(args.mib, args.rounds, args.codec, args.against, args.pairs, args.tls, args.marginal,
                       args.shard_mib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
