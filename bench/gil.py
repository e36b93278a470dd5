"""How long the extractor holds the GIL per GB of hidden states: the most one interpreter can carry.

    sudo .venv/bin/python -m bench.gil [--mib 1024] [--rounds 3] [--shard-mib 1024]

Every thread of one Python process takes turns on one lock, so whatever the extractor does while
holding it runs on one core at most: ``1 / (GIL-held seconds per GB)`` is the ceiling of one process,
whatever the pod's cores (issue 17: "several processes per pod where one interpreter caps").

Measured, not estimated: ``perf probe`` puts uprobes on CPython's own ``take_gil`` (its return: the
thread holds the lock) and ``drop_gil`` (its entry: it lets go), and ``perf record -a`` records them
with every context switch while a real ``hsx extract`` runs (the workload of bench/extractor_cost.py:
B1's rows, the synthetic server, the null S3 sink; both are other processes, filtered out). Per thread,
a hold runs from take to drop; time the holder spent switched out by the kernel (preempted while
holding: this 2-core machine also runs the server and the sink) is reported apart from its time on a
CPU. As in bench/extractor_cost.py each round runs a dataset and one 3x as long that starts with the
same rows; the difference is the figure deep into a run, without start-up (imports and the tokenizer,
all under the GIL). Each probe hit costs a trap (~1-2 us, counted inside the hold it starts or ends),
so the figures are upper bounds; acquisitions per GB are reported to size that bias.

Needs root (uprobes) and perf; without them it says why and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import ROOT
from bench.extractor_cost import PROJECTED_GBPS

PROBE_GROUP = "hsx_gil"
# perf names a return probe "<name>__return".
TAKE, DROP = "take__return", "drop"
PERF_SETTLE_S = 2.0  # perf record -a has its probes in place by then


def libpython() -> Path:
    """The file holding CPython's take_gil/drop_gil: libpython when shared, else the interpreter."""
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        lib = Path(sysconfig.get_config_var("LIBDIR")) / sysconfig.get_config_var("INSTSONAME")
        if lib.exists():
            return lib
    return Path(os.path.realpath(sys.executable))


def unavailable() -> str | None:
    if shutil.which("perf") is None:
        return "perf is not installed"
    if os.geteuid() != 0:
        return "uprobes need root"
    return None


@contextmanager
def gil_probes(binary: Path) -> Iterator[list[str]]:
    """The two uprobes (perf event names), removed afterwards."""
    subprocess.run(["perf", "probe", "-q", "-d", f"{PROBE_GROUP}:*"], capture_output=True, check=False)
    for name, where in (("take", "take_gil%return"), (DROP, "drop_gil")):
        subprocess.run(["perf", "probe", "-q", "-x", str(binary), "-a", f"{PROBE_GROUP}:{name}={where}"],
                       check=True, capture_output=True)
    try:
        yield [f"{PROBE_GROUP}:{TAKE}", f"{PROBE_GROUP}:{DROP}"]
    finally:
        subprocess.run(["perf", "probe", "-q", "-d", f"{PROBE_GROUP}:*"], capture_output=True, check=False)


@dataclass
class Holds:
    """What the threads of one process did with the GIL (seconds)."""

    held: float = 0.0  # from take to drop
    held_switched_out: float = 0.0  # of which the holder was not on a CPU
    acquisitions: int = 0
    threads: int = 0
    # held on a CPU per kind of thread (its name without the pool's numbering: hsx-encode, hsx-part, main)
    by_thread: dict[str, float] = field(default_factory=dict)

    @property
    def held_on_cpu(self) -> float:
        return self.held - self.held_switched_out


def thread_kind(name: str) -> str:
    """A thread's name without its pool's numbering (``hsx-part_3`` -> ``hsx-part``)."""
    return re.sub(r"[-_]\d+(_\d+)?$", "", name)


def holds_of(lines: Iterator[str], pid: int, names: dict[int, str] | None = None) -> Holds:
    """GIL holds of process ``pid`` from ``perf script -F pid,tid,time,event,trace --ns`` lines (pure).

    A thread holds the GIL from a take to its next drop; while holding, from being switched out
    (sched_switch with it as prev) to being switched in (as next) it is off a CPU."""
    taken_at: dict[int, float] = {}
    out_at: dict[int, float] = {}  # tid -> switched out while holding, since
    per_tid: dict[int, float] = {}  # held on a CPU
    ours: set[int] = set()
    result = Holds()
    for line in lines:
        head, _, rest = line.partition(": ")
        fields = head.split()
        if len(fields) < 2 or "/" not in fields[0]:
            continue
        line_pid, tid = (int(x) for x in fields[0].split("/"))
        time = float(fields[1])
        event = rest.split(":", 2)[1] if rest.count(":") >= 2 else ""
        if event == TAKE and line_pid == pid:
            ours.add(tid)
            taken_at[tid] = time
            result.acquisitions += 1
        elif event == DROP and line_pid == pid:
            ours.add(tid)
            start = taken_at.pop(tid, None)
            if start is not None:
                result.held += time - start
                per_tid[tid] = per_tid.get(tid, 0.0) + time - start
        elif event.strip() == "sched_switch":
            prev = int(rest.split("prev_pid=")[1].split()[0])
            nxt = int(rest.split("next_pid=")[1].split()[0])
            if prev in taken_at:
                out_at[prev] = time
            gone = out_at.pop(nxt, None)
            if gone is not None and nxt in taken_at:
                result.held_switched_out += time - gone
                per_tid[nxt] = per_tid.get(nxt, 0.0) - (time - gone)
    result.threads = len(ours)
    for tid, held in per_tid.items():
        kind = thread_kind((names or {}).get(tid, "unnamed"))
        result.by_thread[kind] = result.by_thread.get(kind, 0.0) + held
    return result


CHILD = """
import json, os, sys, threading
sys.path[:0] = [{root!r}, {ext!r}]
from bench.b1_dataplane import run_extract
names = {{threading.get_native_id(): "main"}}
thread_run = threading.Thread.run
def named_run(self):  # which thread is which in the trace (CPython does not name OS threads)
    names[threading.get_native_id()] = self.name
    thread_run(self)
threading.Thread.run = named_run
warm, *traced = json.loads(sys.argv[1])
run_extract(warm)  # imports, tokenizer, first buffers: not in any trace
for cfg in traced:
    print("GIL-BENCH READY", os.getpid(), flush=True)
    sys.stdin.readline()
    run_extract(cfg)
    print("GIL-BENCH DONE", json.dumps(names), flush=True)
"""


def _marker(child: subprocess.Popen[str], what: str) -> str:
    """The child's next ``GIL-BENCH <what>`` line (its runs print their own lines too)."""
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(f"GIL-BENCH {what}"):
            return line
    child.kill()
    raise RuntimeError(f"the traced child exited before GIL-BENCH {what} (exit {child.wait()})")


def traced_runs(cfgs: list[dict[str, Any]], events: list[str], data: Path) -> list[Holds]:
    """``hsx extract`` runs of ``cfgs[1:]`` one after another in one child process (``cfgs[0]`` warms it
    up), each recorded with the probes and the context switches from just before it starts to its end."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(root=str(ROOT), ext=str(ROOT / "extractor")), json.dumps(cfgs)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    out: list[Holds] = []
    try:
        for _ in cfgs[1:]:
            pid = int(_marker(child, "READY").split()[2])
            record = ["perf", "record", "-q", "-a", "-o", str(data), "-e", "sched:sched_switch"]
            for e in events:
                record += ["-e", e]
            perf = subprocess.Popen([*record, "--", "sleep", "3600"], stderr=subprocess.DEVNULL)
            time.sleep(PERF_SETTLE_S)
            child.stdin.write("go\n")
            child.stdin.flush()
            names = {int(k): v for k, v in json.loads(_marker(child, "DONE").split(" ", 2)[2]).items()}
            perf.send_signal(signal.SIGINT)
            perf.wait()
            script = subprocess.Popen(["perf", "script", "-i", str(data), "--ns", "-F", "pid,tid,time,event,trace"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert script.stdout is not None
            out.append(holds_of(iter(script.stdout), pid, names))
            script.wait()
            data.unlink(missing_ok=True)
    finally:
        child.kill()
        child.wait()
    return out


def measure(mib: int, rounds: int, shard_mib: int) -> dict[str, Any]:
    from bench.extractor_cost import workload

    margins: list[dict[str, Any]] = []
    with workload("gil", mib, marginal=True) as w, gil_probes(libpython()) as events:
        assert w.long_rows is not None
        extra_gb = (w.long_raw_bytes - w.raw_bytes) / 1e9
        for r in range(rounds):
            cfgs = [w.config(f"g{tag}{r}", rows, "bf16-zstd", shard_mib)
                    for tag, rows in (("w", w.rows), ("s", w.rows), ("l", w.long_rows))]
            short, long = traced_runs(cfgs, events, w.work / "perf.data")
            margins.append({
                "held_s_per_gb": (long.held - short.held) / extra_gb,
                "held_on_cpu_s_per_gb": (long.held_on_cpu - short.held_on_cpu) / extra_gb,
                "acquisitions_per_gb": (long.acquisitions - short.acquisitions) / extra_gb,
                "threads": long.threads,
                "held_on_cpu_s_per_gb_by_thread": {
                    k: round(v, 4) for k in sorted(set(long.by_thread) | set(short.by_thread))
                    if abs(v := (long.by_thread.get(k, 0.0) - short.by_thread.get(k, 0.0)) / extra_gb) >= 0.001
                },
                "runs": [{"raw_bytes": n, "held_s": h.held, "held_switched_out_s": h.held_switched_out,
                          "acquisitions": h.acquisitions} for n, h in ((w.raw_bytes, short), (w.long_raw_bytes, long))],
            })
    on_cpu = statistics.median(m["held_on_cpu_s_per_gb"] for m in margins)
    return {
        "rounds": margins,
        "held_s_per_gb": round(statistics.median(m["held_s_per_gb"] for m in margins), 3),
        "held_on_cpu_s_per_gb": round(on_cpu, 3),
        "acquisitions_per_gb": round(statistics.median(m["acquisitions_per_gb"] for m in margins)),
        "ceiling_GBps": round(1 / on_cpu, 2),
        "gil_busy_at": {f"{g} GB/s": f"{g * on_cpu:.0%}" for g in PROJECTED_GBPS},
    }


def run_gil(mib: int = 1024, rounds: int = 3, shard_mib: int = 1024) -> dict[str, Any]:
    """The measurement, written to bench/results/gil.json; without perf or root, why it was not made."""
    why = unavailable()
    if why:
        print(f"bench.gil: not measured: {why}", flush=True)
        return {"not_measured": why}
    from bench.common import machine, write_result

    result = {
        "what": "GIL held by hsx extract per GB of hidden states deep into a run (perf uprobes on take_gil/drop_gil)",
        "command": f"python -m bench.gil --mib {mib} --rounds {rounds} --shard-mib {shard_mib}",
        "machine": machine(),
        "shard_mib": shard_mib,
        **measure(mib, rounds, shard_mib),
    }
    write_result("gil", result)
    print(f"GIL held {result['held_s_per_gb']} s per GB ({result['held_on_cpu_s_per_gb']} on a CPU), "
          f"{result['acquisitions_per_gb']} acquisitions per GB: one interpreter carries at most "
          f"{result['ceiling_GBps']} GB/s; GIL busy {result['gil_busy_at']}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-mib", type=int, default=1024, help="shardTargetBytes in MiB (1024: the default)")
    args = ap.parse_args(argv)
    run_gil(args.mib, args.rounds, args.shard_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
