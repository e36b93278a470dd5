"""Several extractor workers in one pod (issue 34, item 3): ``hsx extract`` with ``workers: 2`` supervises two
real extractor processes that lease shards like pods of their own, in their own slots of the request ids
(so neither counts nor sweeps the other's dumps in the shared dump directory), and serves their progress
and metrics as one. A worker that dies is started again and takes its slot's leases at once."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from hsx_extractor.contract import ProgressReport, merge_reports
from hsx_extractor.run.workers import free_port, sum_metrics
from hsx_extractor.tools.verify import run_verify

from .helpers import RefServer, base_config, chat_rows, write_jsonl

HSX = str(Path(sys.executable).parent / "hsx")


def test_merged_progress_takes_the_runs_counts_and_sums_the_work() -> None:
    a = ProgressReport(samplesTotal=100, samplesDone=40, samplesQuarantined=2, tokensDone=900, samplesPerSecond=2.0,
                       shardsLeased=1, requestsInFlight=3, state="running", shardsCommitted=4, shardsTotal=10)
    b = ProgressReport(samplesTotal=100, samplesDone=55, samplesQuarantined=1, tokensDone=1200, samplesPerSecond=3.0,
                       shardsLeased=2, requestsInFlight=1, state="running", shardsCommitted=5, shardsTotal=10)  # fmt: skip
    m = merge_reports([a, b])
    assert (m.samplesDone, m.samplesQuarantined, m.shardsCommitted, m.tokensDone) == (55, 2, 5, 2100)
    assert (m.samplesPerSecond, m.shardsLeased, m.requestsInFlight, m.etaSeconds) == (5.0, 3, 4, 9.0)
    failed = merge_reports([a, b.model_copy(update={"state": "failed", "lastError": "boom"})])
    assert failed.state == "failed" and failed.lastError == "boom"
    done = merge_reports([a.model_copy(update={"state": "succeeded"}), b.model_copy(update={"state": "succeeded"})])
    assert done.state == "succeeded"


def test_metrics_of_workers_sum_by_name_and_labels() -> None:
    one = ('# HELP hsx_samples_done Samples.\n# TYPE hsx_samples_done counter\nhsx_samples_done_total 3.0\n'
           'hsx_samples_done_created 1.7e9\n# HELP hsx_samples_quarantined Q.\n# TYPE hsx_samples_quarantined counter\n'
           'hsx_samples_quarantined_total{reason="empty_messages"} 1.0\n')  # fmt: skip
    two = one.replace("total 3.0", "total 4.0")
    text = sum_metrics([one, two, ""])
    assert "hsx_samples_done_total 7.0" in text and 'hsx_samples_quarantined_total{reason="empty_messages"} 2.0' in text
    assert "_created" not in text


def get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except OSError:
        return None


def test_two_workers_in_one_pod_share_the_run_and_a_killed_worker_comes_back(
    tmp_path: Path, ref_server: RefServer
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(120, words=60))
    port = free_port()
    cfg = base_config(tmp_path, ref_server, dataset, workers=2, concurrency=2, leaseSeconds=2, progressPort=port,
                      progressHost="127.0.0.1", terminationMessagePath=str(tmp_path / "termination.json"))  # fmt: skip
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    log = tmp_path / "extract.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([HSX, "extract", "--config", str(config)], stdout=out, stderr=subprocess.STDOUT)
    try:
        seen: list[dict[str, Any]] = []
        metrics = ""
        killed = False
        while proc.poll() is None:
            report = get_json(f"http://127.0.0.1:{port}/progress")
            if report and report["state"] == "running":
                seen.append(report)
            if not killed and report and report["shardsCommitted"] >= 1:
                # A worker dies without a word (OOM-killed): the supervisor starts it again.
                with contextlib.suppress(OSError):
                    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                for child in _worker_processes(proc.pid, 1):
                    os.kill(child, signal.SIGKILL)
                    killed = True
            time.sleep(0.3)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert killed and "worker 1 exited" in text, text[-4000:]
    lists = re.findall(r"\[w(\d)\] hsx extract: done: .*this process committed shards \[([0-9, ]*)\]", text)
    assert {w for w, _ in lists} == {"0", "1"}, lists
    report = run_verify(str(tmp_path / "out" / "run"))
    assert report.ok and report.to_dict()["duplicates"] == 0, report.summary_text()
    final = json.loads((tmp_path / "termination.json").read_text())
    assert final["state"] == "succeeded" and final["samplesDone"] == final["samplesTotal"] == 120, final
    assert seen and max(r["shardsLeased"] for r in seen) >= 1, seen[-1:]
    assert "hsx_samples_done_total" in metrics, metrics  # both workers' counters, summed


def _worker_processes(pid: int, index: int) -> list[int]:
    """The supervisor's child that runs worker ``index`` (its config file is worker-{index}.json)."""
    out = []
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for child in map(int, children):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(f"worker-{index}.json".encode()) for arg in cmdline):
            out.append(child)
    return out
