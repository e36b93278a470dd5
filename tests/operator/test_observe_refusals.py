"""observe.py and pods.py: runs whose Job or pods cannot be created say why (issue 18, item 1)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from hsx_operator.cluster import create_refusal
from hsx_operator.observe import Refusal, needs_job, observe
from hsx_operator.status import ExtractionJobStatus
from tests.operator.helpers import EXTRACTOR_WAITING, SERVER_READY, job_json, make_spec, pod_json

NOW = datetime(2026, 12, 2, 10, 5, tzinfo=UTC)
INVALID_SELECTOR = (
    'Job.batch "xj-r1" is invalid: spec.template.spec.nodeSelector: Invalid value: "bad key!": name part must '
    "consist of alphanumeric characters"
)
QUOTA = (
    'Error creating: pods "xj-r1-0-abcde" is forbidden: exceeded quota: gpu-quota, requested: pods=1, '
    "used: pods=0, limited: pods=0"
)


def run(**kw: Any) -> Any:
    args: dict[str, Any] = {
        "xj_name": "xj",
        "generation": 1,
        "spec": make_spec(),
        "prior": ExtractionJobStatus(),
        "job": None,
        "pods": [],
        "events": {},
        "progress": {},
        "now": NOW,
    }
    return observe(**{**args, **kw})


def cond(status: ExtractionJobStatus, type_: str) -> tuple[str, str]:
    c = next(c for c in status.conditions if c.type == type_)
    return c.status, c.reason


def api_error(status: int, message: str) -> ApiException:
    exc = ApiException(status=status, reason="Unprocessable Entity")
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return exc


def test_job_rejected_as_invalid_fails_the_run_with_the_api_servers_message() -> None:
    refusal = create_refusal(api_error(422, INVALID_SELECTOR), "Job", "xj-r1")
    assert refusal is not None and refusal.permanent
    out = run(refusal=refusal)
    st = out.status
    assert (st.phase, st.reason) == ("Failed", "InvalidJobSpec")
    assert INVALID_SELECTOR in st.message and "change runId" in st.message
    assert st.completionTime == "2026-12-02T10:05:00Z"
    assert cond(st, "Failed") == ("True", "InvalidJobSpec") and cond(st, "Stalled")[0] == "True"
    warning = [e for e in out.events if e.type == "Warning"]
    assert [e.reason for e in warning] == ["InvalidJobSpec"] and INVALID_SELECTOR in warning[0].message
    # Never created again: the next reconcile (no refusal now, no Job) keeps the failure.
    assert not needs_job(st, None)
    again = run(prior=st, generation=2).status
    assert (again.phase, again.reason, again.message) == ("Failed", "InvalidJobSpec", st.message)


def test_invalid_spec_refusal_fails_the_run() -> None:
    st = run(
        refusal=Refusal("InvalidSpec", "extra_args may not set --tp-siz (--tp-size)", permanent=True)
    ).status
    assert (st.phase, st.reason) == ("Failed", "InvalidSpec") and "--tp-siz" in st.message


def test_other_refusals_stall_the_run_and_are_retried() -> None:
    refusal = create_refusal(
        api_error(403, "jobs.batch is forbidden: exceeded quota: q, count/jobs.batch=0"), "Job", "xj-r1"
    )
    assert refusal is not None and not refusal.permanent
    st = run(refusal=refusal).status
    assert (st.phase, st.reason) == ("Pending", "JobCreateRefused") and "exceeded quota" in st.message
    assert cond(st, "Stalled") == ("True", "JobCreateRefused")
    assert needs_job(st, None)


@pytest.mark.parametrize("code", [409, 429, 401, 500, 503])
def test_answers_not_about_the_object_are_not_refusals(code: int) -> None:
    assert create_refusal(api_error(code, "x"), "Job", "xj-r1") is None


def test_refusal_without_a_message_body_says_the_http_status() -> None:
    refusal = create_refusal(ApiException(status=400, reason="Bad Request"), "ConfigMap", "xj-r1-config")
    assert (
        refusal is not None
        and "HTTP 400 Bad Request" in refusal.message
        and "ConfigMap xj-r1-config" in refusal.message
    )


def failed_create(message: str = QUOTA, at: str = "2026-12-02T10:01:00Z") -> dict[str, Any]:
    return {"reason": "FailedCreate", "type": "Warning", "message": message, "lastTimestamp": at}


def test_failed_create_on_the_job_stalls_the_run_with_the_real_message() -> None:
    plain = run(job=job_json()).status
    assert plain.reason == "PodsPending"  # no event: the Job has not made its pods yet
    st = run(job=job_json(), job_events=[failed_create()]).status
    assert (st.phase, st.reason) == ("Pending", "FailedCreate")
    assert QUOTA in st.message and "Job xj-r1" in st.message
    assert cond(st, "Stalled") == ("True", "FailedCreate")


def test_failed_create_older_than_the_pods_is_history() -> None:
    pod = pod_json(server=SERVER_READY, extractor=EXTRACTOR_WAITING)  # created 10:00:01
    old = failed_create(at="2026-12-02T09:59:00Z")
    st = run(job=job_json(), pods=[pod], job_events=[old]).status
    assert st.reason != "FailedCreate"
    # A replacement pod refused after the first one failed is current again.
    failed_pod = pod_json(phase="Failed")
    st = run(
        job=job_json(), pods=[failed_pod], job_events=[old, failed_create(at="2026-12-02T10:03:00Z")]
    ).status
    assert st.reason == "FailedCreate"


def test_failed_mount_stalls_the_run() -> None:
    pod = pod_json(phase="Pending")
    pod["status"]["initContainerStatuses"] = [
        {"name": "sglang", "ready": False, "state": {"waiting": {"reason": "PodInitializing"}}}
    ]
    message = 'MountVolume.SetUp failed for volume "creds" : secret "s3-creds" not found'
    events = {pod["metadata"]["name"]: [{"reason": "FailedMount", "message": message}]}
    st = run(job=job_json(), pods=[pod], events=events).status
    assert (st.phase, st.reason) == ("Pending", "FailedMount") and message in st.message
    assert cond(st, "Stalled")[0] == "True"
    # Once a container runs, an old FailedMount no longer explains anything.
    pod["status"]["initContainerStatuses"][0]["state"] = {"running": {}}
    assert run(job=job_json(), pods=[pod], events=events).status.reason != "FailedMount"


def test_missing_secret_in_the_environment_stalls_the_run() -> None:
    extractor = {
        "ready": False,
        "state": {
            "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "s3-creds" not found'}
        },
    }
    st = run(
        job=job_json(), pods=[pod_json(phase="Pending", server=SERVER_READY, extractor=extractor)]
    ).status
    assert (st.phase, st.reason) == ("Pending", "CreateContainerConfigError")
    assert 'secret "s3-creds" not found' in st.message and cond(st, "Stalled")[0] == "True"


def test_running_before_the_first_report_never_says_zero_of_zero() -> None:
    extractor = {"ready": True, "state": {"running": {}}}
    st = run(job=job_json(), pods=[pod_json(server=SERVER_READY, extractor=extractor)]).status
    assert st.phase == "Running" and "0/0" not in st.message
