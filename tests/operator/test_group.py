"""group.py, pure: the JobSet of a run whose server spans nodes, and what the operator reads back from it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from hsx_operator.desired import Owner, desired_job
from hsx_operator.group import (
    JOBSET_NAME_LABEL,
    REPLICATED_JOB_LABEL,
    RESTART_EVENT,
    child_jobs,
    desired_jobset,
    desired_run,
    group_name,
    group_status,
    job_view,
    pod_specs,
)
from hsx_operator.observe import Outcome, observe
from hsx_operator.status import ExtractionJobStatus, GroupStatus
from tests.operator.helpers import EXTRACTOR_RUNNING, SERVER_READY, make_spec, pod_json

OWNER = Owner("big", "ml", "uid-1")


def jobset(nodes: int = 3, parallelism: int = 2, **spec: Any) -> dict[str, Any]:
    server = {"nodes": nodes, "gpus": 8, **spec.pop("server", {})}
    return desired_jobset(OWNER, make_spec(server=server, parallelism=parallelism, **spec))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_leader_job_and_one_job_per_other_rank_each_running_every_group() -> None:
    js = jobset()
    assert js["kind"] == "JobSet" and js["metadata"]["name"] == "big-r1"
    assert js["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert js["metadata"]["labels"]["hsx.dev/extractionjob"] == "big"
    assert [r["name"] for r in js["spec"]["replicatedJobs"]] == ["leader", "rank-1", "rank-2"]
    for rjob in js["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        assert rjob["replicas"] == 1 and job["completionMode"] == "Indexed"
        assert job["completions"] == job["parallelism"] == 2 and job["backoffLimit"] == 0
        assert "labels" not in rjob["template"].get("metadata", {})  # the operator never lists them as its Jobs
        assert job["template"]["spec"]["restartPolicy"] == "Never"
    leader, *ranks = (r["template"]["spec"]["template"]["spec"] for r in js["spec"]["replicatedJobs"])
    assert [c["name"] for c in leader["initContainers"]] == ["preflight", "sglang"]
    assert [c["name"] for c in leader["containers"]] == ["extractor"]
    single = desired_job(OWNER, make_spec(server={"gpus": 8}))["spec"]["template"]["spec"]
    assert leader["volumes"] == single["volumes"]
    for rank, pod in enumerate(ranks, start=1):
        assert "initContainers" not in pod
        (server,) = pod["containers"]
        assert server["name"] == "sglang" and server["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert not {"restartPolicy", "startupProbe", "readinessProbe"} & set(server)  # only rank 0 serves HTTP
        assert {v["name"] for v in pod["volumes"]} == {m["name"] for m in server["volumeMounts"]}
        argv = server["command"]
        assert flag(argv, "--node-rank") == str(rank) and flag(argv, "--nnodes") == "3"
        assert flag(argv, "--tp-size") == "24"  # SGLang's --tp counts every node's GPUs
        assert flag(argv, "--dist-init-addr") == "big-r1-leader-0-$(JOB_COMPLETION_INDEX).big-r1:20000"
    (leader_server,) = [c for c in leader["initContainers"] if c["name"] == "sglang"]
    assert flag(leader_server["command"], "--node-rank") == "0"
    assert flag(leader_server["command"], "--dist-init-addr") == flag(ranks[0]["containers"][0]["command"], "--dist-init-addr")


def test_the_jobset_succeeds_with_its_leaders_and_restarts_as_a_whole() -> None:
    js = jobset(backoffLimit=5)["spec"]
    assert js["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["leader"]}
    policy = js["failurePolicy"]
    assert policy["maxRestarts"] == 5 and policy["restartStrategy"] == "BlockingRecreate"
    assert policy["rules"] == [{"name": "permanent-exit", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                                "targetReplicatedJobs": ["leader"]}]  # fmt: skip
    leader_job = js["replicatedJobs"][0]["template"]["spec"]
    # A permanent exit fails the leader's Job by its pod failure policy (that reason), anything else restarts.
    assert [r["action"] for r in leader_job["podFailurePolicy"]["rules"]] == ["FailJob", "FailJob"]
    assert "podFailurePolicy" not in js["replicatedJobs"][1]["template"]["spec"]
    # What JobSet's defaulting webhook would set (the ground runs it without webhooks).
    assert js["startupPolicy"] == {"startupPolicyOrder": "AnyOrder"}
    assert js["network"] == {"enableDNSHostnames": True, "subdomain": "big-r1", "publishNotReadyAddresses": True}


def test_a_queued_group_is_created_suspended_and_labelled_for_kueue() -> None:
    spec = make_spec(server={"nodes": 2}, scheduling={"queueName": "team-a"})
    js = desired_run(OWNER, spec, suspend=True)
    assert js["kind"] == "JobSet" and js["spec"]["suspend"] is True
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert all("suspend" not in r["template"]["spec"] for r in js["spec"]["replicatedJobs"])  # the JobSet's
    assert desired_run(OWNER, make_spec())["kind"] == "Job"
    with pytest.raises(ValueError, match=r"server\.nodes > 1"):
        desired_jobset(OWNER, make_spec())


def test_every_pod_spec_is_checked_against_the_node_access_policy() -> None:
    js = jobset(nodes=2)
    assert len(pod_specs(js)) == 2 and pod_specs(js)[1]["containers"][0]["name"] == "sglang"
    job = desired_job(OWNER, make_spec())
    assert pod_specs(job) == [job["spec"]["template"]["spec"]]


def test_the_child_jobs_are_named_as_jobset_names_them() -> None:
    assert child_jobs("big-r1", 3) == ["big-r1-leader-0", "big-r1-rank-1-0", "big-r1-rank-2-0"]


def test_names_keep_every_hostname_within_a_dns_label() -> None:
    name = group_name("a" * 60, "run-" + "9" * 30)
    assert len(f"{name}-rank-7-0-63") <= 63
    assert group_name("a" * 60, "r1") != group_name("a" * 60, "r2")
    assert group_name("big", "r1") == "big-r1"


def test_a_user_dollar_stays_literal_while_the_leaders_address_expands() -> None:
    js = jobset(nodes=2, server={"extraArgs": ["--served-model-name", "a$(B)"]})
    argv = js["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert flag(argv, "--served-model-name") == "a$$(B)"
    assert "$(JOB_COMPLETION_INDEX)" in flag(argv, "--dist-init-addr")


def jobset_json(*, conditions: list[dict[str, Any]] = (), restarts: int = 0, suspend: bool = False) -> dict[str, Any]:  # type: ignore[assignment]
    js = jobset(nodes=2)
    js["metadata"].update(uid="js-uid", creationTimestamp="2026-12-07T00:00:00Z")
    js["spec"]["suspend"] = suspend
    js["status"] = {"conditions": list(conditions), "restarts": restarts}
    return js


def test_a_jobset_reads_as_the_job_observe_knows() -> None:
    done = {"type": "Completed", "status": "True", "reason": "AllJobsCompleted", "lastTransitionTime": "2026-12-07T01:00:00Z"}
    view = job_view(jobset_json(conditions=[done]))
    assert view["kind"] == "JobSet" and view["metadata"]["uid"] == "js-uid"
    assert view["spec"] == {"suspend": False, "parallelism": 2}
    assert [c["type"] for c in view["status"]["conditions"]] == ["Complete"]
    assert view["status"]["completionTime"] == "2026-12-07T01:00:00Z"
    failed = {"type": "Failed", "status": "True", "reason": "ReachedMaxRestarts", "message": "jobset big-r1 failed"}
    view = job_view(jobset_json(conditions=[failed, {**done, "status": "False"}], suspend=True))
    assert [(c["type"], c["reason"]) for c in view["status"]["conditions"]] == [("Failed", "ReachedMaxRestarts")]
    assert view["spec"]["suspend"] is True and "completionTime" not in view["status"]
    # Its one FailJobSet rule is a pod failure policy's verdict: observe reads it as a Job's and names the exit.
    permanent = {**failed, "reason": "FailJobSetFailurePolicyAction"}
    assert job_view(jobset_json(conditions=[permanent]))["status"]["conditions"][0]["reason"] == "PodFailurePolicy"


def test_a_group_run_fails_at_its_deadline_counted_from_its_start_across_restarts() -> None:
    """A Job's own activeDeadlineSeconds would restart the JobSet and count again from each restart: the
    JobSet's Jobs carry none, and the operator fails the run once the JobSet has run that long."""
    spec = make_spec(server={"nodes": 2, "gpus": 8}, activeDeadlineSeconds=3600)
    one_node = make_spec(activeDeadlineSeconds=3600)
    assert desired_job(OWNER, one_node)["spec"]["activeDeadlineSeconds"] == 3600  # one pod per replica: the Job's own
    assert all("activeDeadlineSeconds" not in r["template"]["spec"] for r in desired_jobset(OWNER, spec)["spec"]["replicatedJobs"])
    # It starts when created, or when last resumed (Kueue's admission); a suspended one has not started.
    assert job_view(jobset_json())["status"]["startTime"] == "2026-12-07T00:00:00Z"
    assert "startTime" not in job_view(jobset_json(suspend=True))["status"]
    resumed = {"type": "Suspended", "status": "False", "reason": "ResumeJobs", "lastTransitionTime": "2026-12-07T00:30:00Z"}
    view = job_view(jobset_json(conditions=[resumed], restarts=2))
    assert view["status"]["startTime"] == "2026-12-07T00:30:00Z"
    # Admitted (spec.suspend false) but not resumed by JobSet yet: not started, whatever its queue time.
    held = {**resumed, "status": "True", "reason": "SuspendJobs"}
    assert job_view(jobset_json(conditions=[held]))["status"]["startTime"] is None
    leader = pod_json("big-r1-leader-0-0-x", server=SERVER_READY, extractor=EXTRACTOR_RUNNING)
    prior = ExtractionJobStatus.model_validate({"observedRunId": "r1", "group": {"jobSet": "big-r1", "nodes": 2, "restarts": 2}})

    def at(hh_mm: str, job: dict[str, Any]) -> Outcome:
        now = datetime.fromisoformat(f"2026-12-07T{hh_mm}:00+00:00")
        return observe(xj_name="big", generation=1, spec=spec, prior=prior, job=job, pods=[leader], events={},
                       progress={}, now=now)  # fmt: skip

    assert (at("01:29", view).status.phase, at("01:29", view).stop_job) == ("Running", False)
    late = at("01:31", view)
    assert late.stop_job and (late.status.phase, late.status.reason) == ("Failed", "DeadlineExceeded")
    assert late.status.message.startswith("JobSet big-r1 ran past activeDeadlineSeconds=3600, 2 restart(s)")
    # A Job's deadline is the Job controller's to enforce: the operator leaves it be.
    as_job = {**view, "kind": "Job"}
    assert (at("01:31", as_job).status.phase, at("01:31", as_job).stop_job) == ("Running", False)


def pod(name: str, rjob: str, index: int, *, phase: str = "Running", ready: bool = True) -> dict[str, Any]:
    server = {"name": "sglang", "ready": ready, "started": True, "state": {"running": {}} if ready else {"waiting": {}}}
    return {
        "metadata": {
            "name": name,
            "labels": {JOBSET_NAME_LABEL: "big-r1", REPLICATED_JOB_LABEL: rjob},
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
        },
        "status": {"phase": phase, ("initContainerStatuses" if rjob == "leader" else "containerStatuses"): [server]},
    }


def test_group_status_lists_each_groups_ranks_and_says_why_the_groups_restarted() -> None:
    pods = [pod("l1", "leader", 1), pod("w0", "rank-1", 0, phase="Pending", ready=False), pod("l0", "leader", 0),
            pod("w1", "rank-1", 1)]  # fmt: skip
    restart = {"reason": RESTART_EVENT, "message": "restarting: first failed job: big-r1-rank-1-0",
               "lastTimestamp": "2026-12-07T00:05:00Z"}  # fmt: skip
    older = {**restart, "message": "older", "lastTimestamp": "2026-12-07T00:01:00Z"}
    status = group_status(jobset_json(restarts=2), pods, [older, {"reason": "Other"}, restart], None)
    assert [(p.name, p.group, p.rank, p.ready) for p in status.pods] == [
        ("l0", 0, 0, True), ("w0", 0, 1, False), ("l1", 1, 0, True), ("w1", 1, 1, True),
    ]  # fmt: skip
    assert (status.jobSet, status.nodes, status.restarts) == ("big-r1", 2, 2)
    assert status.lastRestart == restart["message"] and status.lastRestartTime == "2026-12-07T00:05:00Z"
    # Events expire; what they said stays, for this JobSet only.
    kept = group_status(jobset_json(restarts=2), pods, [], status)
    assert kept.lastRestart == restart["message"]
    other = group_status(jobset_json(), pods, [], GroupStatus(jobSet="big-r0", nodes=2, lastRestart="x"))
    assert other.lastRestart == ""


def test_kueue_topology_places_each_pod_set_and_groups_the_two_of_a_two_node_group() -> None:
    rack = {"queueName": "q", "topology": {"level": "example.com/rack"}}
    two = jobset(nodes=2, parallelism=1, scheduling=rack)
    for rjob in two["spec"]["replicatedJobs"]:
        annotations = rjob["template"]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["kueue.x-k8s.io/podset-required-topology"] == "example.com/rack"
        assert annotations["kueue.x-k8s.io/podset-group-name"] == "leader"
    # Kueue groups exactly two pod sets, one of them a single pod: three ranks, or two groups, are not that.
    for nodes, parallelism in ((3, 1), (2, 2)):
        js = jobset(nodes=nodes, parallelism=parallelism, scheduling={**rack, "topology": {"level": "r", "mode": "Preferred"}})
        for rjob in js["spec"]["replicatedJobs"]:
            annotations = rjob["template"]["spec"]["template"]["metadata"]["annotations"]
            assert annotations["kueue.x-k8s.io/podset-preferred-topology"] == "r"
            assert "kueue.x-k8s.io/podset-group-name" not in annotations
    single = desired_job(OWNER, make_spec(scheduling=rack))["spec"]["template"]["metadata"]["annotations"]
    assert single["kueue.x-k8s.io/podset-required-topology"] == "example.com/rack"
