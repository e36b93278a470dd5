"""Runs whose server spans nodes (server.nodes > 1) under JobSet's real controller (v0.11.1, built from its Go module,
tests/ground/jobset.py) and Kueue's (v0.17.0, with its JobSet integration).

SGLang 0.5.23 cannot run a server over two CPU processes (docs/sglang.md), so each group's leader runs hsx's CPU
reference server and its other rank a stand-in that holds its pod as a rank's scheduler does (tests/ground/images.py).
What is under test is the group's lifecycle: one JobSet per run, a lost worker pod recreating every group (the run
resuming with no sample lost or written twice, status.group saying why), and Kueue admitting or holding a group as
a whole.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from hsx_operator.group import JOBSET_NAME_LABEL, REPLICATED_JOB_LABEL
from tests.ground.jobset import jobset_installed
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import SLOW, missing_from, phase, rendered, run_store, start_slow_run, verify
from tests.operator.kube_helpers import Namespace, xj_manifest
from tests.operator.test_e2e_failures import WRONG_FINGERPRINT
from tests.operator.test_e2e_kueue import kueue_with_quota, own_output

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TWO_NODES = {"nodes": 2, "gpus": 1}


def group_pods(ns: Namespace, jobset: str) -> list[dict[str, Any]]:
    return [p for p in ns.items("pods", f"{JOBSET_NAME_LABEL}={jobset}") if not p["metadata"].get("deletionTimestamp")]


def rank_of(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"][REPLICATED_JOB_LABEL])


@pytest.fixture
def jobset(ns: Namespace, node_agent: Any) -> Iterator[None]:
    with jobset_installed(ns.cluster, node_agent):
        try:
            yield
        finally:
            ns.kubectl("delete", "jobsets.jobset.x-k8s.io", "--all", "--wait=true", "--timeout=60s", check=False)


def test_a_lost_worker_recreates_the_group_and_the_run_resumes_exactly_once(
    tmp_path: Path,
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    jobset: None,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    op = start_operator()
    env = own_output({**run_env, "dataset": long_dataset}, "group")
    run_dir = start_slow_run(ns, "big", env, server={**SLOW["server"], **TWO_NODES})
    assert ns.get("job", "big-r1") is None  # one JobSet, no Job of hsx's own
    # `hsx render -f` shows the JobSet the operator creates: the API server only adds its defaults.
    manifest = xj_manifest("big", "r1", **env, **{**SLOW, "server": {**SLOW["server"], **TWO_NODES}})
    _, want = rendered(ns, manifest, tmp_path)
    created = ns.get("jobset.jobset.x-k8s.io", "big-r1")
    assert created is not None and want["kind"] == "JobSet"
    assert missing_from(created["spec"], want["spec"]) == []
    pods = wait_for(lambda: len(group_pods(ns, "big-r1")) == 2 and group_pods(ns, "big-r1"), 60, "both ranks")
    assert sorted(rank_of(p) for p in pods) == ["leader", "rank-1"]
    worker = next(p for p in pods if rank_of(p) == "rank-1")
    argv = worker["spec"]["containers"][0]["command"]
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--dist-init-addr") + 1] == "big-r1-leader-0-$(JOB_COMPLETION_INDEX).big-r1:20000"
    assert [c["name"] for c in worker["spec"]["containers"]] == ["sglang"] and not worker["spec"].get("initContainers")
    status = wait_for(lambda: (ns.status("big").get("group") or {}).get("pods") and ns.status("big"), 60, "status.group")
    assert status["group"]["jobSet"] == "big-r1" and status["group"]["nodes"] == 2, status["group"]

    # The worker rank is lost: its Job fails, JobSet recreates every Job of the run, the extractor resumes.
    ns.kubectl("delete", "pod", worker["metadata"]["name"], "--grace-period=0", "--force", "--wait=false")
    # The restart count is the JobSet's status, its reason JobSet's event (recorded a moment later).
    restarted = wait_for(
        lambda: (group := ns.status("big").get("group") or {}).get("restarts", 0) >= 1 and group.get("lastRestart")
        and ns.status("big"),
        180,
        "the group to restart and say why",
    )
    assert "big-r1-rank-1-0" in restarted["group"]["lastRestart"], restarted["group"]
    done = wait_for(phase(ns, "big", "Succeeded", "Failed"), 480, "the run to end")
    assert done["phase"] == "Succeeded", (done, op.tail())
    assert done["group"] is None or done["group"]["restarts"] >= 1
    report = verify(run_dir)
    rows = len(long_dataset.read_bytes().splitlines())
    assert report["ok"] and report["duplicates"] == 0, report
    assert report["samples"] + report["quarantined"] == rows, report
    store = run_store(env["output"], "r1")
    assert len(store.committed_shards()) == len(json.loads((run_dir / "plan.json").read_text())["shards"])
    assert "JobCreated" in ns.event_reasons("big")
    # Deleting the ExtractionJob removes its JobSet (the finalizer waits for it); the data stays.
    ns.kubectl("delete", "xj", "big", "--wait=true", "--timeout=120s")
    assert ns.get("jobset.jobset.x-k8s.io", "big-r1") is None
    assert (run_dir / "manifest.json").exists()


def test_a_group_run_ends_at_its_deadline_counted_across_restarts(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    jobset: None,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    """activeDeadlineSeconds is the run's, from its JobSet's start: a restart does not start it again (a Job's own
    deadline would), and reaching it ends the run rather than restarting the group."""
    start_operator()
    # The worker is lost 40 s or more into the run: counted from that restart, the run would end 40 s or more past
    # its deadline. Unhindered, at 3 s a request, the run would take about twice its deadline.
    deadline, lost_after, server = 150, 40, {"extraArgs": ["--delay-ms", "3000"], **TWO_NODES}
    env = own_output({**run_env, "dataset": long_dataset}, "late")
    applied = time.monotonic()
    ns.apply(xj_manifest("late", "r1", **env, server=server, concurrency=2, activeDeadlineSeconds=deadline))
    wait_for(phase(ns, "late", "Running", "Succeeded", "Failed"), 90, "Running")
    created = ns.get("jobset.jobset.x-k8s.io", "late-r1")
    assert created is not None
    assert [r["template"]["spec"].get("activeDeadlineSeconds") for r in created["spec"]["replicatedJobs"]] == [None, None]
    time.sleep(max(0.0, lost_after - (time.monotonic() - applied)))
    worker = next(p for p in group_pods(ns, "late-r1") if rank_of(p) == "rank-1")
    ns.kubectl("delete", "pod", worker["metadata"]["name"], "--grace-period=0", "--force", "--wait=false")
    seen = wait_for(lambda: ((ns.status("late").get("group") or {}).get("restarts", 0) >= 1
                             or ns.status("late").get("phase") in ("Succeeded", "Failed")) and ns.status("late"),
                    120, "the group to restart")  # fmt: skip
    assert (seen.get("group") or {}).get("restarts", 0) >= 1, seen
    failed = wait_for(phase(ns, "late", "Succeeded", "Failed"), deadline + 120, "the run to end")
    assert (failed["phase"], failed["reason"]) == ("Failed", "DeadlineExceeded"), failed
    assert failed["message"].startswith(f"JobSet late-r1 ran past activeDeadlineSeconds={deadline}, 1 restart(s)"), failed
    ran = (datetime.fromisoformat(failed["completionTime"]) - datetime.fromisoformat(failed["startTime"])).total_seconds()
    assert deadline <= ran < deadline + lost_after - 10, (ran, failed)  # from the JobSet's start, not its restart
    wait_for(lambda: ns.get("jobset.jobset.x-k8s.io", "late-r1") is None, 60, "the JobSet to be deleted")
    assert (env["output"] / "r1" / "plan.json").exists()  # the run's output stays


@pytest.fixture
def kueue_with_jobset(ns: Namespace, node_agent: Any, jobset: None) -> Iterator[None]:
    with kueue_with_quota(ns, node_agent, gpus=2, frameworks=("batch/job", "jobset.x-k8s.io/jobset")):
        yield


def test_kueue_admits_a_group_whole_and_holds_the_next_one_whole(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    kueue_with_jobset: None,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    """Two GPUs of quota, two runs of one 2-node group each (a GPU per pod): the first is admitted with both its
    pods, the second waits with none (never one pod of it alone) and runs once the first is done."""
    start_operator()
    first_env = own_output({**run_env, "dataset": long_dataset}, "first")
    start_slow_run(ns, "first", first_env, server={**SLOW["server"], **TWO_NODES}, scheduling={"queueName": "team-a"})
    assert len(group_pods(ns, "first-r1")) == 2
    second_env = own_output(run_env, "second")
    ns.apply(xj_manifest("second", "r1", **second_env, server=TWO_NODES, scheduling={"queueName": "team-a"}))
    held = wait_for(lambda: ns.status("second").get("reason") == "Queued" and ns.status("second"), 120, "Queued")
    assert held["phase"] == "Suspended" and "Kueue holds JobSet second-r1 in queue team-a" in held["message"], held
    # One Workload per run, its pod sets the group's ranks, admitted whole; the held run has no pod at all.
    workloads = {w["metadata"]["ownerReferences"][0]["name"]: w for w in ns.items("workloads.kueue.x-k8s.io")}
    first_wl, second_wl = workloads["first-r1"], workloads["second-r1"]
    assert [(p["name"], p["count"]) for p in first_wl["spec"]["podSets"]] == [("leader", 1), ("rank-1", 1)]
    assert (first_wl["status"].get("admission") or {}).get("podSetAssignments"), first_wl["status"]
    assert not second_wl["status"].get("admission"), second_wl["status"]
    assert ns.status("first")["phase"] == "Running"  # SLOW: still holding the quota
    assert group_pods(ns, "second-r1") == [], "a pod of a held group was created"
    done = wait_for(phase(ns, "first", "Succeeded", "Failed"), 480, "the first run to end")
    assert done["phase"] == "Succeeded", done
    second = wait_for(phase(ns, "second", "Succeeded", "Failed"), 300, "the second run to end")
    assert second["phase"] == "Succeeded", second
    report = verify(second_env["output"] / "r1")
    assert report["ok"] and report["duplicates"] == 0, report


def test_a_permanent_failure_fails_the_group_without_restarting_it(
    ns: Namespace, run_env: dict[str, Any], jobset: None, start_operator: Callable[[], OperatorProcess]
) -> None:
    """A configuration error (the preflight's permanent exit) fails the leader's Job by its pod failure policy,
    and the JobSet's rule on that reason fails the run at once: no restart loads the weights again."""
    start_operator()
    manifest = xj_manifest("wrongtok", "r1", **run_env, server=TWO_NODES, backoffLimit=3)
    manifest["spec"]["dataset"]["expectedTokenizerFingerprint"] = WRONG_FINGERPRINT
    ns.apply(manifest)
    failed = wait_for(phase(ns, "wrongtok", "Failed"), 240, "the run to fail")
    assert failed["reason"] == "PreflightFailed", failed
    assert "preflight exited 3 (permanent failure)" in failed["message"], failed
    created = ns.get("jobset.jobset.x-k8s.io", "wrongtok-r1")
    assert created is not None and created["status"].get("restarts", 0) == 0, (created or {}).get("status")
    conditions = {c["type"]: c for c in created["status"]["conditions"]}
    assert conditions["Failed"]["status"] == "True"
    assert conditions["Failed"]["reason"] == "FailJobSetFailurePolicyAction", conditions["Failed"]


def test_a_group_whose_pods_cannot_be_created_says_why(
    ns: Namespace, run_env: dict[str, Any], jobset: None, start_operator: Callable[[], OperatorProcess]
) -> None:
    """The pods of a JobSet are created by its Jobs: their FailedCreate (here a quota of no pods) is the run's
    reason, as a Job's own is for a one-pod run."""
    start_operator()
    ns.forbid_pods()
    ns.apply(xj_manifest("quota", "r1", **run_env, server=TWO_NODES))
    stalled = wait_for(lambda: ns.status("quota").get("reason") == "FailedCreate" and ns.status("quota"), 120,
                       "reason FailedCreate")  # fmt: skip
    assert stalled["phase"] == "Pending", stalled
    assert "JobSet quota-r1 cannot create its pods" in stalled["message"], stalled
    assert "exceeded quota: no-pods" in stalled["message"], stalled
