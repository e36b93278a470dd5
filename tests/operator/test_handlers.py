"""handlers._reconcile with a fake cluster: what it reads, creates and reports (no API server)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import pytest
from kubernetes.client.rest import ApiException

from hsx_operator import cluster as cluster_module
from hsx_operator import handlers
from hsx_operator.policy import NodeAccessPolicy
from hsx_operator.status import ExtractionJobStatus
from tests.operator.helpers import (
    EXTRACTOR_RUNNING,
    EXTRACTOR_WAITING,
    SERVER_LOADING,
    SERVER_READY,
    job_json,
    pod_json,
    spec_dict,
)

UID = "uid-1"


class FakeCluster:
    def __init__(
        self,
        jobs: list[dict[str, Any]] | None = None,
        refuse: ApiException | None = None,
        server_time: datetime | None = None,
        pods: list[dict[str, Any]] | None = None,
    ):
        self.jobs = jobs or []
        self.refuse = refuse
        self.server_time = server_time or datetime.now(UTC)
        self.pods = pods
        self.calls: list[str] = []

    def now(self) -> datetime:
        return self.server_time

    def jobs_of(self, owner: Any) -> list[dict[str, Any]]:
        return self.jobs

    def jobsets_of(self, owner: Any) -> list[dict[str, Any]]:
        return []

    def create_or_read(self, owner: Any, manifest: dict[str, Any], kind: str) -> dict[str, Any]:
        self.calls.append(f"create {kind}")
        if kind == "Job" and self.refuse is not None:
            raise self.refuse
        return {**manifest, "status": {}}

    def pods_of(self, namespace: str, job: str, kind: str = "Job") -> list[dict[str, Any]]:
        self.calls.append("pods")
        return self.pods if self.pods is not None else [pod_json(server=SERVER_READY, extractor=EXTRACTOR_RUNNING)]

    def events_of(self, namespace: str, name: str, kind: str = "Pod") -> list[dict[str, Any]]:
        self.calls.append(f"events {kind}")
        return []

    def kueue_view(self, namespace: str, job_uid: str) -> Any:
        from hsx_operator.pods import KueueView

        self.calls.append("kueue")
        return KueueView(served=False)

    def patch_job(self, *args: Any) -> None:
        self.calls.append("patch")

    def delete_job(self, *args: Any) -> None:
        self.calls.append("delete")


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {"polls": 0, "events": []}

    def poll(*args: Any) -> None:
        seen["polls"] += 1

    monkeypatch.setattr(cluster_module, "poll_progress", poll)
    monkeypatch.setattr(kopf, "event", lambda body, **kw: seen["events"].append(kw))
    monkeypatch.setattr(kopf, "info", lambda body, **kw: seen["events"].append({"type": "Normal", **kw}))
    return seen


def reconcile(
    monkeypatch: pytest.MonkeyPatch, cluster: FakeCluster, spec: dict[str, Any], status: dict[str, Any]
) -> kopf.Patch:
    monkeypatch.setattr(handlers, "Cluster", lambda: cluster)
    # spec_dict's model is a hostPath under /srv: allowed as the admin would for it.
    monkeypatch.setattr(handlers, "POLICY", NodeAccessPolicy.of(["/srv"]))
    patch = kopf.Patch()
    handlers._reconcile(
        body=kopf.Body({}),
        name="xj",
        namespace="ns",
        uid=UID,
        spec=spec,
        status=status,
        patch=patch,
        generation=1,
    )
    return patch


def owned(job: dict[str, Any]) -> dict[str, Any]:
    job["metadata"]["ownerReferences"] = [{"uid": UID}]
    job["metadata"]["labels"] = {}
    return job


def test_a_finished_run_is_neither_read_nor_polled(
    monkeypatch: pytest.MonkeyPatch, world: dict[str, Any]
) -> None:
    done = ExtractionJobStatus(phase="Succeeded", observedRunId="r1", jobName="xj-r1", reason="Completed")
    job = owned(job_json(conditions=[{"type": "Complete", "status": "True"}]))
    cluster = FakeCluster([job])
    patch = reconcile(monkeypatch, cluster, spec_dict(), done.model_dump(mode="json"))
    assert cluster.calls == [] and world["polls"] == 0
    assert "phase" not in patch.get("status", {})


def test_a_live_run_is_read_and_polled(monkeypatch: pytest.MonkeyPatch, world: dict[str, Any]) -> None:
    running = ExtractionJobStatus(
        phase="Running", observedRunId="r1", jobName="xj-r1", startTime="2026-12-02T10:00:00Z"
    )
    cluster = FakeCluster([owned(job_json())])
    reconcile(monkeypatch, cluster, spec_dict(), running.model_dump(mode="json"))
    assert cluster.calls == ["pods", "events Job"] and world["polls"] == 1


def test_a_job_the_api_server_rejects_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, world: dict[str, Any]
) -> None:
    exc = ApiException(status=422, reason="Unprocessable Entity")
    exc.body = json.dumps(
        {"message": 'Job.batch "xj-r1" is invalid: spec.template.spec.tolerations[0].operator: Invalid value'}
    )
    cluster = FakeCluster(refuse=exc)
    patch = reconcile(monkeypatch, cluster, spec_dict(), {})
    st = patch["status"]
    assert (st["phase"], st["reason"]) == ("Failed", "InvalidJobSpec") and "tolerations[0].operator" in st[
        "message"
    ]
    assert cluster.calls == ["create ConfigMap", "create Job"]
    assert any(e.get("type") == "Warning" and e["reason"] == "InvalidJobSpec" for e in world["events"])


def test_extra_args_the_launcher_refuses_fail_the_run_without_a_job(
    monkeypatch: pytest.MonkeyPatch, world: dict[str, Any]
) -> None:
    # An abbreviation of --tp-size: the CRD refuses it too; an older CRD would let it through.
    spec = spec_dict(server={"extraArgs": ["--tp-siz", "2"]})
    cluster = FakeCluster()
    st = reconcile(monkeypatch, cluster, spec, {})["status"]
    assert (st["phase"], st["reason"]) == ("Failed", "InvalidSpec")
    assert "--tp-siz (--tp-size)" in st["message"] and cluster.calls == []


def test_a_queued_job_asks_whether_kueue_holds_it(
    monkeypatch: pytest.MonkeyPatch, world: dict[str, Any]
) -> None:
    job = owned(job_json(suspend=True))
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    job["metadata"]["uid"] = "job-uid"
    pending = ExtractionJobStatus(
        phase="Pending", observedRunId="r1", jobName="xj-r1", startTime="2026-12-02T10:00:00Z"
    )
    cluster = FakeCluster([job])
    spec = spec_dict(scheduling={"queueName": "team-a"})
    st = reconcile(monkeypatch, cluster, spec, pending.model_dump(mode="json"))["status"]
    assert "kueue" in cluster.calls
    assert (st["phase"], st["reason"]) == ("Suspended", "KueueNotInstalled")


def test_a_host_path_the_admin_did_not_allow_fails_the_run_without_a_job(
    monkeypatch: pytest.MonkeyPatch, world: dict[str, Any]
) -> None:
    cluster = FakeCluster()
    spec = spec_dict(model={"path": "/models/tiny", "source": {"hostPath": {"path": "/var/lib/kubelet"}}})
    st = reconcile(monkeypatch, cluster, spec, {})["status"]
    assert (st["phase"], st["reason"]) == ("Failed", "NotPermitted")
    assert "host path /var/lib/kubelet" in st["message"] and "allowed prefixes: /srv" in st["message"]
    assert cluster.calls == []
    assert any(e.get("type") == "Warning" and e["reason"] == "NotPermitted" for e in world["events"])


def test_the_startup_deadline_runs_on_the_api_servers_clock(
    monkeypatch: pytest.MonkeyPatch, world: dict[str, Any]
) -> None:
    # The Job's timestamps are the API server's; this machine's clock is months ahead of it.
    created = datetime(2026, 1, 5, 12, 0, 0, tzinfo=UTC)
    job = owned(job_json())
    job["metadata"]["creationTimestamp"] = job["status"]["startTime"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    loading = [pod_json(server=SERVER_LOADING, extractor=EXTRACTOR_WAITING)]
    spec = spec_dict(startupDeadlineSeconds=600)

    def at(server_seconds: int, status: dict[str, Any]) -> dict[str, Any]:
        cluster = FakeCluster([job], server_time=created + timedelta(seconds=server_seconds), pods=loading)
        return {**status, **reconcile(monkeypatch, cluster, spec, status)["status"]}

    early = at(300, {"observedRunId": "r1"})
    assert early["phase"] == "Starting", early
    late = at(900, early)
    assert (late["phase"], late["reason"]) == ("Failed", "StartupDeadlineExceeded"), late


def test_server_clock_reads_the_date_header_and_adds_the_time_since() -> None:
    from hsx_operator.cluster import server_clock

    got = server_clock("Mon, 05 Jan 2026 12:00:00 GMT", seen_at=100.0, now_monotonic=102.5)
    assert got == datetime(2026, 1, 5, 12, 0, 2, 500000, tzinfo=UTC)
    assert server_clock(None, 0, 0) is None and server_clock("not a date", 0, 0) is None
