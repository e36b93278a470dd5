"""Engines: what hsx's dump hook costs per request on the real SGLang server. CPU NUMBERS.

    .venv/bin/python -m bench.engines [--engine sglang|vllm] [--rounds 9] [--requests 32] [--concurrency 8]

``--engine vllm`` measures hsx's vLLM connector the same way (``run_vllm``).

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


def _vllm_round(server: Any, lengths: list[int], extract: bool, tag: str, concurrency: int) -> dict[str, Any]:
    """One round of /v1/completions (one token); with ``extract`` each carries a rid and the round
    ends when the last dump is on disk, as the extractor waits for it."""
    import json
    import urllib.request

    from hsx_extractor import protocol

    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(5, 512, n).tolist() for n in lengths]
    rids = [f"bench-{tag}-{i}" for i in range(len(prompts))]
    latencies: list[float] = []

    def send(i: int) -> None:
        body: dict[str, Any] = {"prompt": prompts[i], "max_tokens": 1, "temperature": 0}
        if extract:
            body["kv_transfer_params"] = {protocol.VLLM_RID_PARAM: rids[i]}
        req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
        latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, range(len(prompts))))
    if extract:
        wanted = [protocol.dump_path(server.dump_dir, rid) for rid in rids]
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in wanted):
            if time.monotonic() > deadline:
                raise RuntimeError(f"dumps missing after 120 s in {server.dump_dir}")
            time.sleep(0.002)
    seconds = time.perf_counter() - t0
    if extract:
        for p in server.dump_dir.iterdir():
            p.unlink()
    return {"seconds": seconds, "p50_latency_s": statistics.median(latencies)}


def run_vllm(rounds: int = 9, requests: int = 32, concurrency: int = 8) -> dict[str, Any]:
    """vLLM: the extraction-mode server (hsx's launcher, extract_hidden_states + hsx's connector) sent
    extraction requests (with a rid: a dump each) and plain ones (no rid), against plain vLLM (no
    extraction flags) sent plain requests. No control server (each vLLM holds ~4 GB here)."""
    from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tiny_model
    from tests.engines import vllm_venv
    from tests.engines.vllm_server import CPU_ARGS, VLLMServer

    if not vllm_venv.is_built():
        raise SystemExit(f"the vLLM CPU venv is not built at {vllm_venv.venv_dir()}: run bash tests/engines/build_vllm.sh")
    lengths = [int(n) for n in np.random.default_rng(SEED).integers(16, 401, requests)]
    work = scratch("engines-vllm")
    print(f"engines (CPU, vLLM): {requests} requests of 16..400 tokens, {concurrency} in flight, {rounds} rounds")
    servers: dict[str, Any] = {}
    try:
        model = build_tiny_model(work / "model", TinyModelSpec(num_heads=2, num_kv_heads=1))
        hsx = vllm_venv.install_hsx(Path(tempfile.mkdtemp(dir=work, prefix="hsx-")) / "site")
        servers["connector"] = VLLMServer(model, hsx, work / "vllm-connector").start()
        servers["plain vllm"] = VLLMServer(model, hsx, work / "vllm-plain", hook=False).start()
        pairs = [("connector", True), ("connector", False), ("plain vllm", False)]
        samples: dict[tuple[str, bool], list[dict[str, Any]]] = {pair: [] for pair in pairs}
        for r in range(-1, rounds):  # round -1 warms every path up and is dropped
            order = pairs if r % 2 == 0 else pairs[::-1]
            for name, extract in order:
                res = _vllm_round(servers[name], lengths, extract, f"{name[0]}{int(extract)}-r{r}", concurrency)
                if r >= 0:
                    samples[(name, extract)].append(res)
        tokens = sum(lengths)
        runs = {
            f"{name}, {'extraction' if extract else 'plain'}": {
                "median_round_s": statistics.median(x["seconds"] for x in got),
                "rounds_s": [x["seconds"] for x in got],
                "ms_per_request": 1000 * statistics.median(x["seconds"] for x in got) / requests,
                "tokens_per_s": tokens / statistics.median(x["seconds"] for x in got),
                "median_p50_latency_s": statistics.median(x["p50_latency_s"] for x in got),
            }
            for (name, extract), got in samples.items()
        }
        m = {k: v["median_round_s"] for k, v in runs.items()}
        ratios = {
            # The headline: extracting with hsx on vLLM vs the same vLLM serving the prompts plainly.
            "connector extraction / plain vllm plain": m["connector, extraction"] / m["plain vllm, plain"],
            # extract_hidden_states mode itself, on requests that write no dump.
            "connector plain / plain vllm plain": m["connector, plain"] / m["plain vllm, plain"],
            # The connector's copy and file write per request.
            "connector extraction / connector plain": m["connector, extraction"] / m["connector, plain"],
        }
        result = {
            "device": "cpu",
            "note": "CPU numbers: real vLLM 0.32 (CPU build) with a tiny random Llama (8 layers, H=64, 2 heads, "
            "float32, eager); not representative of GPU serving; the CUDA copy path is not exercised",
            "seed": SEED, "server_cpu_args": list(CPU_ARGS), "requests_per_round": requests,
            "tokens_per_round": tokens, "concurrency": concurrency, "rounds": rounds,
            "server_start_s": {name: s.start_seconds[-1] for name, s in servers.items()},
            "runs": runs, "ratios": ratios,
        }  # fmt: skip
        path = write_result("engines_vllm", result)
        print("\nengines, vLLM (CPU NUMBERS, tiny model):")
        for name, v in runs.items():
            print(f"  {name:30} {v['median_round_s']:6.2f}s/round  {v['ms_per_request']:7.1f} ms/request")
        for name, v in ratios.items():
            print(f"  ratio {name:42} {v:.2f} (medians)")
        print(f"  written to {path}")
        return result
    finally:
        for s in servers.values():
            s.stop()
        rmtree(work)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="hsx's extraction overhead per request (real SGLang or vLLM, CPU)")
    p.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    run = run_vllm if args.engine == "vllm" else run_engines
    return run(args.rounds, args.requests, args.concurrency)


if __name__ == "__main__":
    main()
