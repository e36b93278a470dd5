"""A run's tail with a slow member: shards leased (hsx now) against shards assigned ``k % n == r`` (hsx before
leases, and SpecForge's, speculators' and Model-Optimizer's static split), in one run, alternating.

    .venv/bin/python -m bench.fleet_tail [--rows 400] [--rounds 3] [--members 4] [--slow 5]

Each member is a real ``hsx extract`` with its own reference server, as pods would be. The servers' time is
their prefill delay (``--delay-ms`` per request plus ``--delay-us-per-token``), so the members' speeds are
set, not this VM's cores: member 1 is ``--slow`` times slower. The dataset is skewed: 10% of its rows are 10x
longer. The static baseline runs the same extractor with its leases pinned to ``k % n == r`` and no takeover
or race (what the code did before leases), so the two differ in that alone.

The ideal is the work divided by the fleet's combined speed (all request time at one member's concurrency,
over the sum of the members' relative speeds) plus the start-up the members spend before their first request
(measured: all members started at once on a finished run, sharing the cores as in a run). Results: bench/results/fleet_tail.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_result

HSX = str(Path(sys.executable).parent / "hsx")
BASE_MS = 20.0
PER_TOKEN_US = 1000.0
CONCURRENCY = 2


def dataset(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud", "seven", "maple"]
    with path.open("w") as out:
        for i in range(rows):
            n = 200 if i % 10 == 3 else 20  # 10% of the rows 10x longer
            text = " ".join(rng.choice(words) for _ in range(n))
            out.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"say {i}"},
                                                              {"role": "assistant", "content": text}]}) + "\n")
    return path


def static_member(config: str, replica: int, count: int) -> int:
    """One member with the old static assignment: leases only its own ``k % count == replica``, no takeover."""
    from hsx_extractor.config import ExtractConfig
    from hsx_extractor.run import leases, readers
    from hsx_extractor.run.runner import run_extract

    def claim(self: leases.Leases, shard: int) -> bool:
        return shard % count == replica and self._create(shard, 0, "claim")

    leases.Leases.claim = claim  # type: ignore[method-assign]
    readers.work_left = lambda *_: None  # its own shards only: no takeover, no race, no wait
    return run_extract(ExtractConfig.model_validate_json(Path(config).read_text()))


class Fleet:
    def __init__(self, work: Path, model: Path, rows: int, members: int, slow: float) -> None:
        self.work, self.model, self.members, self.slow = work, model, members, slow
        self.data = dataset(work / "data.jsonl", rows)
        self.servers: list[tuple[subprocess.Popen[bytes], str, Path]] = []

    def start_servers(self) -> None:
        from hsx_extractor.run.workers import free_port

        for m in range(self.members):
            factor = self.slow if m == 1 else 1.0
            port, dumps = free_port(), self.work / f"dumps-{m}"
            proc = subprocess.Popen(
                [HSX, "serve-reference", "--model", str(self.model), "--dump-dir", str(dumps), "--host", "127.0.0.1",
                 "--port", str(port), "--threads", "1", "--delay-ms", str(BASE_MS * factor),
                 "--delay-us-per-token", str(PER_TOKEN_US * factor)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            self.servers.append((proc, f"http://127.0.0.1:{port}", dumps))
        for _, url, _ in self.servers:
            wait_healthy(url)

    def stop(self) -> None:
        for proc, _, _ in self.servers:
            proc.terminate()
            proc.wait(timeout=30)

    def config(self, run_id: str, m: int) -> Path:
        _, url, dumps = self.servers[m]
        path = self.work / f"{run_id}-{m}.json"
        path.write_text(json.dumps({
            "runId": run_id, "dataset": {"uri": str(self.data), "maxLength": 2048},
            "output": {"uri": str(self.work / "out"), "shardTargetBytes": 1 << 20}, "modelPath": str(self.model),
            "serverUrl": url, "dumpDir": str(dumps), "concurrency": CONCURRENCY, "progressPort": 0,
            "logIntervalSeconds": 600, "replicaIndex": m, "replicaCount": self.members, "leaseSeconds": 5,
            "validation": {"consistency": {"samplesPerShard": 0}},
        }))  # fmt: skip
        return path

    def lease_events(self, run_id: str) -> dict[str, int]:
        """What the members' logs say they did beyond their own claims: takeovers and races."""
        logs = [(self.work / f"{run_id}-{m}.log").read_text() for m in range(self.members)]
        return {"takeovers": sum(log.count("hsx: leases: took over") for log in logs),
                "races": sum(log.count("hsx: leases: racing shard") for log in logs)}  # fmt: skip

    def run(self, run_id: str, static: bool) -> float:
        began = time.perf_counter()
        procs = []
        for m in range(self.members):
            config = str(self.config(run_id, m))
            cmd = ([sys.executable, "-m", "bench.fleet_tail", "--static-member", config, str(m), str(self.members)]
                   if static else [HSX, "extract", "--config", config])  # fmt: skip
            log = (self.work / f"{run_id}-{m}.log").open("wb")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        codes = [p.wait(timeout=3600) for p in procs]
        if codes != [0] * self.members:
            tails = [(self.work / f"{run_id}-{m}.log").read_text()[-2000:] for m in range(self.members)]
            raise SystemExit(f"{run_id}: exit codes {codes}\n" + "\n\n".join(tails))
        return time.perf_counter() - began

    def startup(self, run_id: str) -> float:
        """Every member started at once on a finished run: what the fleet spends before any request (imports,
        tokenizer, plan), with the members sharing this machine's cores as they do in a run."""
        began = time.perf_counter()
        procs = [subprocess.Popen([HSX, "extract", "--config", str(self.config(run_id, m))], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for m in range(self.members)]  # fmt: skip
        if [p.wait(timeout=600) for p in procs] != [0] * self.members:
            raise SystemExit("a member started on a finished run failed")
        return time.perf_counter() - began

    def work_seconds(self) -> float:
        """All request time of the dataset at one normal member (its prefill delays), over its concurrency."""
        from hsx_extractor.run.dataset import Prepared, read_samples
        from hsx_extractor.run.sources import iter_rows
        from hsx_extractor.run.tokens import ChatTokenizer

        tok = ChatTokenizer(str(self.model))
        lengths = [s.length for s in read_samples(iter_rows(str(self.data)), tok, 2048) if isinstance(s, Prepared)]
        return sum(BASE_MS / 1000 + n * PER_TOKEN_US / 1e6 for n in lengths) / CONCURRENCY


def wait_healthy(url: str, timeout: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} not healthy")


def run_fleet_tail(rows: int, rounds: int, members: int, slow: float) -> dict[str, Any]:
    from hsx_extractor.tools.tinymodel import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="hsx-fleet-") as tmp:
        work = Path(tmp)
        fleet = Fleet(work, build_tiny_model(work / "model"), rows, members, slow)
        fleet.start_servers()
        try:
            times: dict[str, list[float]] = {"static": [], "leased": []}
            events: list[dict[str, int]] = []
            for r in range(rounds):
                for mode in ("static", "leased"):
                    times[mode].append(fleet.run(f"{mode}-{r}", mode == "static"))
                    if mode == "leased":
                        events.append(fleet.lease_events(f"{mode}-{r}"))
                    print(f"round {r} {mode}: {times[mode][-1]:.1f}s", *events[-1:] if mode == "leased" else [],
                          flush=True)  # fmt: skip
            startup = statistics.median(fleet.startup("leased-0") for _ in range(3))
            work_s = fleet.work_seconds()
        finally:
            fleet.stop()
    speed = (members - 1) + 1 / slow
    ideal = work_s / speed + startup
    median = {mode: statistics.median(ts) for mode, ts in times.items()}
    result = {
        "what": f"wall time of a {members}-member fleet (member 1 {slow:g}x slower, 10% of rows 10x longer): shards "
                "leased vs assigned k % n == r, against the ideal (work / combined speed + start-up)",
        "command": f"python -m bench.fleet_tail --rows {rows} --rounds {rounds} --members {members} --slow {slow:g}",
        "median_seconds": {k: round(v, 2) for k, v in median.items()},
        "ideal_seconds": round(ideal, 2),
        "startup_seconds": round(startup, 2),
        "work_seconds_at_one_member": round(work_s, 2),
        "leased_over_ideal": round(median["leased"] / ideal, 3),
        "static_over_ideal": round(median["static"] / ideal, 3),
        "static_over_leased": round(median["static"] / median["leased"], 3),
        "rounds": {k: [round(t, 2) for t in v] for k, v in times.items()},
        "leased_rounds_lease_events": events,
        "cpus": os.cpu_count(),
    }
    write_result("fleet_tail", result)
    print(json.dumps({k: result[k] for k in ("median_seconds", "ideal_seconds", "leased_over_ideal",
                                             "static_over_ideal", "static_over_leased")}), flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_tail", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--slow", type=float, default=5.0)
    p.add_argument("--static-member", nargs=3, metavar=("CONFIG", "REPLICA", "COUNT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.static_member:
        config, replica, count = args.static_member
        return static_member(config, int(replica), int(count))
    run_fleet_tail(args.rows, args.rounds, args.members, args.slow)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
