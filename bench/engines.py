"""Engines: what hsx's dump hook costs per request on the real SGLang server. CPU NUMBERS.

    .venv/bin/python -m bench.engines [--rounds 9] [--requests 32] [--concurrency 8]

Real SGLang servers (the pinned release, the SGLang CPU venv of ``tests/engines/build_sglang.sh``,
the tiny random Llama on CPU), started with the same argv (the operator's launcher plus CPU flags):
one with ``SGLANG_HS_DUMP_DIR`` set (the hook active), one without (plain SGLang), and a second one
without, sent plain requests only, as a control: the ratio of the two identical servers is the
server-to-server noise of this machine, against which the hook's ratios are to be read. Each round
sends the same requests (lengths 16..400, ``--concurrency`` in flight) to each server in two kinds:

* ``extraction``: what hsx sends (``return_hidden_states``, one new token). With the hook the round
  ends when the last dump file is on disk (the extractor waits for it too); without the hook SGLang
  returns the states in the HTTP answer as JSON lists (its own way, which hsx replaces).
* ``plain``: one new token, no hidden states: the same work without extraction.

Rounds are interleaved over servers and kinds (this machine is shared); medians are reported. The
headline ratio is hook + extraction over plain SGLang without the hook: the price of extracting
with hsx per request. On CPU the forward of a tiny model is cheap, so this overstates the share the
hook's copy and write take next to a real model on a GPU, and it says nothing about the CUDA
staging path (pinned copies, events), which only ``bench/gpu_smoke.sh`` exercises.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import rmtree, scratch, write_result

SEED = 1515
KINDS = ("plain", "extraction")
CONTROL = "no hook (control)"


def _bodies(lengths: list[int], kind: str, round_no: int, server: str) -> list[dict[str, Any]]:
    rng = np.random.default_rng(SEED)
    out = []
    for i, n in enumerate(lengths):
        body: dict[str, Any] = {
            "input_ids": rng.integers(0, 512, n).tolist(),
            "rid": f"bench-{server}-{kind}-r{round_no}-{i}",
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }
        if kind == "extraction":
            body["return_hidden_states"] = True
        out.append(body)
    return out


def _one_round(
    server: Any, bodies: list[dict[str, Any]], concurrency: int, dumps: Path | None
) -> dict[str, Any]:
    latencies: list[float] = []

    def send(body: dict[str, Any]) -> int:
        t = time.perf_counter()
        answer = server.generate(body, timeout=300)
        latencies.append(time.perf_counter() - t)
        states = answer.get("meta_info", {}).get("hidden_states") or []
        return len(states)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        returned = list(pool.map(send, bodies))
    answered = time.perf_counter() - t0
    if dumps is not None:  # the hook writes from a thread: wait for every dump, as the extractor does
        wanted = [dumps / f"{b['rid']}.safetensors" for b in bodies]
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in wanted):
            if time.monotonic() > deadline:
                raise RuntimeError(f"dumps missing after 120 s in {dumps}")
            time.sleep(0.002)
    seconds = time.perf_counter() - t0
    if dumps is not None:
        for p in dumps.iterdir():
            p.unlink()
    return {
        "seconds": seconds,
        "answered_seconds": answered,
        "p50_latency_s": statistics.median(latencies),
        "rows_in_http": sum(returned),
    }


def run_engines(rounds: int = 9, requests: int = 32, concurrency: int = 8) -> dict[str, Any]:
    from hsx_extractor.tools.tinymodel import build_tiny_model
    from tests.engines.sglang_server import CPU_ARGS, SGLangServer
    from tests.engines.sglang_venv import install_hook, install_hsx, is_built, venv_dir

    if not is_built():
        raise SystemExit(
            f"the SGLang CPU venv is not built at {venv_dir()}: run bash tests/engines/build_sglang.sh"
        )
    rng = np.random.default_rng(SEED)
    lengths = [int(n) for n in rng.integers(16, 401, requests)]
    work = scratch("engines")
    print(
        f"engines (CPU): {requests} requests of 16..400 tokens, {concurrency} in flight, {rounds} rounds",
        flush=True,
    )
    servers: dict[str, Any] = {}
    try:
        model = build_tiny_model(work / "model")
        hsx = install_hsx(Path(tempfile.mkdtemp(dir=work, prefix="hsx-")) / "site")
        install_hook(hsx)
        # One at a time: two starting servers would fight over the cores. With --sleep-on-idle an
        # idle one costs nothing, so both stay up and rounds interleave.
        servers["hook"] = SGLangServer(model, hsx, work / "sglang-hook", hook=True).start()
        servers["no hook"] = SGLangServer(model, hsx, work / "sglang-plain", hook=False).start()
        # A second plain server, plain requests only: how far two identical servers differ here.
        servers[CONTROL] = SGLangServer(model, hsx, work / "sglang-control", hook=False).start()
        for name, s in servers.items():
            print(f"  server {name!r} ready in {s.start_seconds[-1]:.0f}s", flush=True)
        pairs = [(s, k) for s in servers for k in KINDS if not (s == CONTROL and k == "extraction")]
        samples: dict[tuple[str, str], list[dict[str, Any]]] = {pair: [] for pair in pairs}
        for r in range(-1, rounds):  # round -1 warms every path up and is dropped
            order = list(pairs)
            if r % 2:
                order.reverse()
            for name, kind in order:
                server = servers[name]
                dumps = server.dump_dir if (name == "hook" and kind == "extraction") else None
                res = _one_round(server, _bodies(lengths, kind, r, name.replace(" ", "")), concurrency, dumps)
                if r >= 0:
                    samples[(name, kind)].append(res)
            if r >= 0:
                print(f"  round {r}: " + ", ".join(f"{s}/{k} {samples[(s, k)][-1]['seconds']:.2f}s"
                                                    for s, k in order), flush=True)  # fmt: skip
        tokens = sum(lengths)
        runs: dict[str, Any] = {}
        for (name, kind), got in samples.items():
            med = statistics.median(x["seconds"] for x in got)
            runs[f"{name}, {kind}"] = {
                "hook": name == "hook",
                "requests": kind,
                "median_round_s": med,
                "best_round_s": min(x["seconds"] for x in got),
                "rounds_s": [x["seconds"] for x in got],
                "ms_per_request": 1000 * med / requests,
                "tokens_per_s": tokens / med,
                "median_p50_latency_s": statistics.median(x["p50_latency_s"] for x in got),
                "hidden_state_rows_in_http": got[-1]["rows_in_http"],
            }
        m = {k: v["median_round_s"] for k, v in runs.items()}
        b = {k: v["best_round_s"] for k, v in runs.items()}
        ratios_best = {
            "hook extraction / no-hook plain": b["hook, extraction"] / b["no hook, plain"],
            "hook plain / no-hook plain": b["hook, plain"] / b["no hook, plain"],
            "hook extraction / no-hook return_hidden_states": b["hook, extraction"]
            / b["no hook, extraction"],
            "control: no-hook plain / second no-hook plain": b["no hook, plain"] / b[f"{CONTROL}, plain"],
        }
        ratios = {
            # The headline: extracting with hsx vs the same SGLang serving the same prompts plainly.
            "hook extraction / no-hook plain": m["hook, extraction"] / m["no hook, plain"],
            # The hook's cost on requests that do not extract (it only wraps one method): ~1,
            # to be read against the control below.
            "hook plain / no-hook plain": m["hook, plain"] / m["no hook, plain"],
            # hsx's dump files vs SGLang's own return of the same states as JSON over HTTP.
            "hook extraction / no-hook return_hidden_states": m["hook, extraction"]
            / m["no hook, extraction"],
            # Two identical servers without the hook: this machine's server-to-server spread.
            "control: no-hook plain / second no-hook plain": m["no hook, plain"] / m[f"{CONTROL}, plain"],
        }
        result = {
            "device": "cpu",
            "note": "CPU numbers: real SGLang on CPU with a tiny random Llama (8 layers, H=64, float32); "
            "not representative of GPU serving; the CUDA staging path is not exercised",
            "seed": SEED,
            "sglang_venv": str(venv_dir()),
            "server_cpu_args": list(CPU_ARGS),
            "requests_per_round": requests,
            "tokens_per_round": tokens,
            "concurrency": concurrency,
            "rounds": rounds,
            "server_start_s": {name: s.start_seconds[-1] for name, s in servers.items()},
            "runs": runs,
            "ratios": ratios,
            "ratios_of_best_rounds": ratios_best,
            "noisy": abs(ratios["control: no-hook plain / second no-hook plain"] - 1) > 0.1,
        }
        path = write_result("engines", result)
        print("\nengines (CPU NUMBERS, tiny model):")
        for name, v in runs.items():
            print(f"  {name:36} {v['median_round_s']:6.2f}s/round  {v['ms_per_request']:7.1f} ms/request  "
                  f"{v['tokens_per_s']:8.0f} tok/s")  # fmt: skip
        for name, v in ratios.items():
            print(f"  ratio {name:46} {v:.2f} (medians)  {ratios_best[name]:.2f} (best rounds)")
        control = ratios["control: no-hook plain / second no-hook plain"]
        if abs(control - 1) > 0.1:
            print(f"  WARNING: two identical servers differ by {control:.2f}x here (load or placement): "
                  "the ratios above are within this machine's noise; rerun on a quiet machine")  # fmt: skip
        print(f"  written to {path}")
        return result
    finally:
        for s in servers.values():
            s.stop()
        rmtree(work)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="hsx's SGLang hook overhead per request (real SGLang, CPU)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    return run_engines(args.rounds, args.requests, args.concurrency)


if __name__ == "__main__":
    main()
