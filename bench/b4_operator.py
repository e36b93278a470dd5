"""B4, the operator: time from applying an ExtractionJob to its Job existing (p50/p95), and 200
ExtractionJobs reconciled with 0 errors, with the operator's peak RSS, on the test control
plane (real etcd + kube-apiserver + controller-manager + scheduler, started like tests/ground/kube.py).

    .venv/bin/python -m bench.b4_operator [--total 200] [--sequential 20]

The first ``--sequential`` ExtractionJobs are applied one at a time (each waits for its Job):
latency without queueing. The rest are applied back to back: latency under a burst. The Jobs
are created suspended (spec.suspend) so 200 eight-GPU pods do not pile up on a 2-core machine;
the operator's work (validate, ConfigMap, Job, status) is the same. Job creation is seen
through a watch on Jobs, timed on this machine's monotonic clock.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import PeakSampler, rmtree, scratch, write_result

SEED = 8404
POLL_SECONDS = "10"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def manifest(name: str, work: Path) -> dict[str, Any]:
    from tests.operator.kube_helpers import xj_manifest

    doc = xj_manifest(name, "r1", model_root=work / "models", dataset=work / "data.jsonl", output=work / "out")
    doc["spec"]["suspend"] = True
    return doc


class JobWatch:
    """First time each Job is seen (monotonic seconds), from a watch on the namespace's Jobs."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client, watch

        self.batch = client.BatchV1Api(api)
        self.namespace = namespace
        self.seen: dict[str, float] = {}
        self._watch = watch.Watch()
        self._cond = threading.Condition()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching before the control plane goes (a thread left retrying breaks interpreter exit)."""
        self._stopped.set()
        self._watch.stop()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        from hsx_operator.desired import LABEL_XJ

        while not self._stopped.is_set():
            try:
                for event in self._watch.stream(self.batch.list_namespaced_job, self.namespace, timeout_seconds=300):
                    owner = (event["object"].metadata.labels or {}).get(LABEL_XJ)
                    if owner:
                        with self._cond:
                            self.seen.setdefault(owner, time.monotonic())
                            self._cond.notify_all()
            except Exception:  # a dropped watch is reopened; a lost event only delays one sample
                time.sleep(0.2)

    def wait_for(self, names: set[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not names <= set(self.seen):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True


def run_b4(total: int = 200, sequential: int = 20) -> dict[str, Any]:
    from kubernetes import client

    from tests.ground.kube import start_kube_cluster, wait_for_default_service_account

    work = scratch("b4")
    print(f"B4: starting the control plane; {sequential} sequential + {total - sequential} burst ExtractionJobs",
          flush=True)
    try:
        with start_kube_cluster(work / "kube") as cluster:
            root = Path(__file__).resolve().parents[1]
            cluster.kubectl("apply", "-f", str(root / "crds"))
            cluster.kubectl("wait", "--for=condition=Established", "crd/extractionjobs.hsx.dev", "--timeout=60s")
            ns = "bench"
            cluster.kubectl("create", "namespace", ns)
            wait_for_default_service_account(cluster, ns)
            api = cluster.api_client()
            custom = client.CustomObjectsApi(api)
            watch = JobWatch(api, ns)
            log = work / "operator.log"
            env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HSX_OPERATOR_POLL_SECONDS": POLL_SECONDS}
            with log.open("wb") as out:
                op = subprocess.Popen([str(Path(sys.executable).parent / "hsx-operator"), "-n", ns,
                                       "--metrics-port", "0", f"--allow-host-path={work}"], env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                with PeakSampler(op.pid, interval=0.2) as peaks:
                    applied: dict[str, float] = {}

                    def apply(name: str) -> None:
                        custom.create_namespaced_custom_object("hsx.dev", "v1alpha1", ns, "extractionjobs",
                                                               manifest(name, work))
                        applied[name] = time.monotonic()

                    for i in range(sequential):
                        apply(f"seq-{i:03d}")
                        if not watch.wait_for({f"seq-{i:03d}"}, 120):
                            raise RuntimeError(f"no Job for seq-{i:03d} within 120s:\n{log.read_text()[-3000:]}")
                    burst_start = time.monotonic()
                    burst = [f"burst-{i:03d}" for i in range(total - sequential)]
                    for name in burst:
                        apply(name)
                    all_jobs = watch.wait_for(set(applied), 600)
                    burst_seconds = time.monotonic() - burst_start
                    reconciled = wait_reconciled(custom, ns, set(applied), 300)
                    time.sleep(2 * float(POLL_SECONDS))  # a few timer rounds with all of them live
                    rss = peaks.peak_rss
            finally:
                watch.close()
                op.terminate()
                op.wait(timeout=30)
            text = log.read_text(errors="replace")
            jobs = client.BatchV1Api(api).list_namespaced_job(ns).items
            per_xj: dict[str, int] = {}
            for job in jobs:
                owner = (job.metadata.labels or {}).get("hsx.dev/extractionjob", "")
                per_xj[owner] = per_xj.get(owner, 0) + 1
        # kopf logs a retried API request at ERROR ("Request attempt #1/9 failed; will retry"): a
        # transport hiccup it recovers from, counted apart from handler failures.
        lines = text.splitlines()
        retries = [line for line in lines if "Request attempt #" in line]
        errors = [line for line in lines if line not in retries
                  and re.search(r"\bERROR\b|Traceback|failed with an exception", line)]
        latencies = {name: watch.seen[name] - t for name, t in applied.items() if name in watch.seen}
        seq = [latencies[f"seq-{i:03d}"] for i in range(sequential)]
        bur = [latencies[n] for n in burst if n in latencies]
        results = {
            "seed": SEED, "total": total, "sequential": sequential, "poll_seconds": POLL_SECONDS,
            "all_jobs_created": all_jobs, "jobs": len(jobs), "duplicate_jobs": sum(n - 1 for n in per_xj.values()),
            "reconciled_with_status": reconciled, "operator_errors": len(errors), "error_lines": errors[:10],
            "api_request_retries": len(retries), "retry_lines": retries[:10],
            "sequential_p50_s": statistics.median(seq), "sequential_p95_s": percentile(seq, 0.95),
            "burst_p50_s": statistics.median(bur), "burst_p95_s": percentile(bur, 0.95),
            "burst_seconds_to_all_jobs": burst_seconds, "operator_peak_rss_bytes": rss,
        }
    finally:
        rmtree(work)
    print_b4(results)
    write_result("b4_operator", results)
    return results


def wait_reconciled(custom: Any, ns: str, names: set[str], timeout: float) -> int:
    """How many ExtractionJobs carry a status phase (the operator reconciled them) once all do or time is up."""
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        items = custom.list_namespaced_custom_object("hsx.dev", "v1alpha1", ns, "extractionjobs")["items"]
        done = sum(1 for x in items if x["metadata"]["name"] in names and (x.get("status") or {}).get("phase"))
        if done == len(names):
            break
        time.sleep(1)
    return done


def print_b4(r: dict[str, Any]) -> None:
    print(f"\nB4 operator ({r['total']} ExtractionJobs):")
    print(f"  apply -> Job, one at a time   p50 {r['sequential_p50_s']:.2f}s  p95 {r['sequential_p95_s']:.2f}s")
    print(f"  apply -> Job, burst of {r['total'] - r['sequential']:<6} p50 {r['burst_p50_s']:.2f}s  "
          f"p95 {r['burst_p95_s']:.2f}s  (all Jobs in {r['burst_seconds_to_all_jobs']:.1f}s)")
    print(f"  Jobs {r['jobs']}, duplicates {r['duplicate_jobs']}, reconciled {r['reconciled_with_status']}, "
          f"operator errors {r['operator_errors']}, peak RSS {r['operator_peak_rss_bytes'] / 2**20:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--total", type=int, default=200)
    p.add_argument("--sequential", type=int, default=20)
    args = p.parse_args(argv)
    run_b4(args.total, args.sequential)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

