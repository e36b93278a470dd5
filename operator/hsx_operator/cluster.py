"""The operator's cluster I/O: the few API calls it makes and the extractors' /progress poll.

Everything returns plain camelCase dicts, the input of the pure functions in observe/desired.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes
from kubernetes.client.rest import ApiException

from hsx_operator import metrics
from hsx_operator.desired import EXTRACTOR_CONTAINER, LABEL_XJ, Owner

PROGRESS_TIMEOUT = 2.0


def _json(response: Any) -> Any:
    return json.loads(response.data)


class Cluster:
    """The few API calls the operator makes, returning plain camelCase dicts."""

    def __init__(self) -> None:
        self.core = kubernetes.client.CoreV1Api()
        self.batch = kubernetes.client.BatchV1Api()

    def jobs_of(self, owner: Owner) -> list[dict[str, Any]]:
        got = _json(
            self.batch.list_namespaced_job(
                owner.namespace, label_selector=f"{LABEL_XJ}={owner.name}", _preload_content=False
            )
        )
        return [
            j
            for j in got["items"]
            if any(r.get("uid") == owner.uid for r in j["metadata"].get("ownerReferences") or [])
        ]

    def create_or_read(self, owner: Owner, manifest: dict[str, Any], kind: str) -> dict[str, Any]:
        ns, name = owner.namespace, manifest["metadata"]["name"]
        create: Any = (
            self.batch.create_namespaced_job if kind == "Job" else self.core.create_namespaced_config_map
        )
        read: Any = self.batch.read_namespaced_job if kind == "Job" else self.core.read_namespaced_config_map
        try:
            return _json(create(ns, manifest, _preload_content=False))  # type: ignore[no-any-return]
        except ApiException as exc:
            if exc.status != 409:
                raise
        existing = _json(read(name, ns, _preload_content=False))
        if not any(r.get("uid") == owner.uid for r in existing["metadata"].get("ownerReferences") or []):
            raise kopf.TemporaryError(
                f"{kind} {name} exists but belongs to another object; waiting for it to go", delay=5
            )
        return existing  # type: ignore[no-any-return]

    def pods_of(self, namespace: str, job: str) -> list[dict[str, Any]]:
        got = _json(
            self.core.list_namespaced_pod(
                namespace, label_selector=f"batch.kubernetes.io/job-name={job}", _preload_content=False
            )
        )
        return got["items"]  # type: ignore[no-any-return]

    def events_of(self, namespace: str, pod: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.kind=Pod,involvedObject.name={pod}"
        got = _json(
            self.core.list_namespaced_event(namespace, field_selector=selector, _preload_content=False)
        )
        return sorted(got["items"], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def patch_job(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.batch.patch_namespaced_job(name, namespace, body)

    def delete_job(self, namespace: str, name: str, propagation: str) -> None:
        try:
            self.batch.delete_namespaced_job(name, namespace, propagation_policy=propagation)
        except ApiException as exc:
            if exc.status != 404:
                raise


def poll_progress(pod: Mapping[str, Any], port: int, run_id: str) -> dict[str, Any] | None:
    ip = pod.get("status", {}).get("podIP")
    states = {
        c.get("name"): c.get("state") or {} for c in pod.get("status", {}).get("containerStatuses") or []
    }
    if not ip or "running" not in states.get(EXTRACTOR_CONTAINER, {}):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/progress", timeout=PROGRESS_TIMEOUT) as resp:
            report = json.loads(resp.read())
    except (OSError, ValueError):
        metrics.ERRORS.labels(kind="progress").inc()
        return None
    if not isinstance(report, dict) or report.get("runId", run_id) != run_id:
        return None
    return report
