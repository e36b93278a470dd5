"""Queued only when Kueue is installed and holds the Job (issue 18, item 5): the Job's own queue label,
and Kueue's Workload for it, decide; a queueName on a cluster without Kueue says so."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hsx_operator.observe import observe
from hsx_operator.pods import KueueView
from hsx_operator.status import ExtractionJobStatus
from tests.operator.helpers import job_json, make_spec

NOW = datetime(2026, 12, 2, 10, 5, tzinfo=UTC)
QUEUED_SPEC = make_spec(scheduling={"queueName": "team-a"})


def queued_job() -> dict[str, Any]:
    job = job_json(suspend=True)
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    return job


def workload(*conditions: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "job-xj-r1-1a2b3"}, "status": {"conditions": list(conditions)}}


def run(job: dict[str, Any], kueue: KueueView | None, spec: Any = QUEUED_SPEC) -> ExtractionJobStatus:
    return observe(
        xj_name="xj",
        generation=1,
        spec=spec,
        prior=ExtractionJobStatus(),
        job=job,
        pods=[],
        events={},
        progress={},
        now=NOW,
        kueue=kueue,
    ).status


def stalled(st: ExtractionJobStatus) -> str:
    return next(c.status for c in st.conditions if c.type == "Stalled")


def test_queued_when_kueue_has_a_workload_for_the_job_with_kueues_words() -> None:
    pending = workload(
        {
            "type": "QuotaReserved",
            "status": "False",
            "reason": "Pending",
            "message": "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu",
        }
    )
    st = run(queued_job(), KueueView(served=True, workloads=(pending,)))
    assert (st.phase, st.reason) == ("Suspended", "Queued")
    assert "queue team-a" in st.message and "insufficient quota for nvidia.com/gpu" in st.message
    evicted = workload(
        {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "preempted by x"}
    )
    st = run(queued_job(), KueueView(served=True, workloads=(evicted,)))
    assert st.reason == "Queued" and "evicted: preempted by x" in st.message


def test_without_kueues_api_the_run_says_kueue_is_not_installed() -> None:
    st = run(queued_job(), KueueView(served=False))
    assert (st.phase, st.reason) == ("Suspended", "KueueNotInstalled")
    assert "install Kueue" in st.message and stalled(st) == "True"
    assert run(queued_job(), None).reason == "KueueNotInstalled"


def test_kueue_without_a_workload_yet_is_not_queued() -> None:
    st = run(queued_job(), KueueView(served=True, workloads=()))
    assert (st.phase, st.reason) == ("Suspended", "WaitingForWorkload")
    assert "does not manage this namespace" in st.message


def test_unreadable_workloads_fall_back_to_the_jobs_label() -> None:
    st = run(queued_job(), KueueView(served=True, workloads=None))
    assert st.reason == "Queued"


def test_a_suspended_job_without_a_queue_label_is_not_queued() -> None:
    # spec.queueName alone does not make it queued: the Job itself must carry Kueue's label.
    st = run(job_json(suspend=True), KueueView(served=True, workloads=(workload(),)))
    assert (st.phase, st.reason) == ("Suspended", "JobSuspended")
    by_spec = run(queued_job(), None, spec=make_spec(suspend=True, scheduling={"queueName": "team-a"}))
    assert by_spec.reason == "Suspended"


def test_a_queued_group_is_named_as_the_jobset_kueue_holds() -> None:
    from hsx_operator.desired import Owner
    from hsx_operator.group import desired_jobset, job_view

    spec = make_spec(server={"nodes": 2}, scheduling={"queueName": "team-a"})
    jobset = desired_jobset(Owner("xj", "ml", "u"), spec, suspend=True)
    jobset["status"] = {}
    st = run(job_view(jobset), KueueView(served=True, workloads=()), spec)
    assert st.reason == "WaitingForWorkload" and st.message.startswith("JobSet xj-r1 waits for Kueue")
    assert "jobset.x-k8s.io/jobset in Kueue's integrations.frameworks" in st.message
    pending = workload({"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "no quota"})
    st = run(job_view(jobset), KueueView(served=True, workloads=(pending,)), spec)
    assert st.reason == "Queued" and "Kueue holds JobSet xj-r1 in queue team-a" in st.message
