"""kopf wiring: read the world, call the pure functions in desired/observe, write what they say.

Every trigger (create, spec update, resume after an operator restart, and a periodic timer) runs
the same idempotent :func:`reconcile`. Job names are deterministic, so a second operator or a
restarted one finds the Job instead of creating another (creation answers 409 AlreadyExists).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import kopf
import kubernetes
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from hsx_operator import metrics
from hsx_operator.api import GROUP, PLURAL, TERMINAL_PHASES, VERSION, ExtractionJobSpec, ExtractionJobStatus
from hsx_operator.desired import (
    EXTRACTOR_CONTAINER,
    LABEL_RUN,
    LABEL_XJ,
    Owner,
    desired_config_map,
    desired_job,
    initial_suspend,
    job_name,
)
from hsx_operator.observe import needs_job, observe

POLL_SECONDS = float(os.environ.get("HSX_OPERATOR_POLL_SECONDS", "5"))
PROGRESS_TIMEOUT = 2.0
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
log = logging.getLogger("hsx_operator")


def _lock(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # kopf's bookkeeping goes into annotations: the status schema would prune it, and spec is the user's.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 120
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


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


def _finished(job: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in job.get("status", {}).get("conditions") or []
    )


def _poll_progress(pod: Mapping[str, Any], port: int, run_id: str) -> dict[str, Any] | None:
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


def _status_patch(prior: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level status fields that changed (merge-patch semantics: None removes)."""
    return {k: v for k, v in new.items() if prior.get(k) != v}


def reconcile(
    *,
    trigger: str,
    body: kopf.Body,
    name: str,
    namespace: str,
    uid: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    patch: kopf.Patch,
    generation: int,
) -> None:
    started = time.monotonic()
    try:
        with _lock(uid):
            _reconcile(
                body=body,
                name=name,
                namespace=namespace,
                uid=uid,
                spec=spec,
                status=status,
                patch=patch,
                generation=generation,
            )
    except Exception:
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    metrics.RECONCILES.labels(trigger=trigger, result="ok").inc()


def _reconcile(
    *,
    body: kopf.Body,
    name: str,
    namespace: str,
    uid: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    patch: kopf.Patch,
    generation: int,
) -> None:
    now = datetime.now(UTC)
    try:
        xj = ExtractionJobSpec.model_validate(dict(spec))
    except ValidationError as exc:
        # The API server accepted it, so the CRD and the models disagree: say so, touch nothing.
        patch.status.update(
            {
                "phase": "Failed",
                "reason": "InvalidSpec",
                "message": str(exc)[:4000],
                "observedGeneration": generation,
            }
        )
        return
    prior_raw = dict(status or {})
    prior = ExtractionJobStatus.model_validate(prior_raw)
    owner = Owner(name=name, namespace=namespace, uid=uid)
    cluster = Cluster()
    current = job_name(name, xj.runId)
    jobs = cluster.jobs_of(owner)
    for other in jobs:
        # A runId change supersedes the old run: stop its pods, keep its data and its finished Job.
        if (
            other["metadata"]["name"] != current
            and not _finished(other)
            and not other["metadata"].get("deletionTimestamp")
        ):
            cluster.delete_job(namespace, other["metadata"]["name"], "Background")
            kopf.info(
                body,
                reason="RunSuperseded",
                message=f"run {other['metadata']['labels'].get(LABEL_RUN)} stopped: runId is now {xj.runId}",
            )
    job = next((j for j in jobs if j["metadata"]["name"] == current), None)
    run_status = (
        prior
        if prior.observedRunId == xj.runId
        else ExtractionJobStatus.model_validate({"observedRunId": xj.runId})
    )
    if needs_job(run_status, job):
        cluster.create_or_read(owner, desired_config_map(owner, xj), "ConfigMap")
        job = cluster.create_or_read(owner, desired_job(owner, xj, suspend=initial_suspend(xj)), "Job")
        metrics.JOBS_CREATED.inc()
        kopf.info(body, reason="JobCreated", message=f"created Job {current} for run {xj.runId}")
    elif job is not None and not _finished(job) and run_status.phase not in TERMINAL_PHASES:
        want = True if xj.suspend else (None if xj.scheduling.queueName else False)
        if want is not None and bool(job["spec"].get("suspend")) != want:
            cluster.patch_job(namespace, current, {"spec": {"suspend": want}})
            job["spec"]["suspend"] = want
            kopf.info(
                body,
                reason="Suspended" if want else "Resumed",
                message=f"Job {current} {'suspended' if want else 'resumed'}",
            )
    pods = cluster.pods_of(namespace, current) if job is not None else []
    events = {
        p["metadata"]["name"]: cluster.events_of(namespace, p["metadata"]["name"])
        for p in pods
        if p["status"].get("phase") == "Pending"
    }
    with ThreadPoolExecutor(max_workers=8) as pool:
        reports = dict(
            zip(
                [p["metadata"]["name"] for p in pods],
                pool.map(lambda p: _poll_progress(p, xj.extractor.progressPort, xj.runId), pods),
                strict=True,
            )
        )
    outcome = observe(
        xj_name=name,
        generation=generation,
        spec=xj,
        prior=prior,
        job=job,
        pods=pods,
        events=events,
        progress={k: v for k, v in reports.items() if v},
        now=now,
    )
    if outcome.stop_job and job is not None:
        _stop(cluster, namespace, current)
    for note in outcome.events:
        kopf.event(body, type=note.type, reason=note.reason, message=note.message)
    new = outcome.status.model_dump(mode="json")
    changed = _status_patch(prior_raw, new)
    if changed:
        patch.status.update(changed)
    metrics.record_phase(uid, outcome.status.phase)


def _stop(cluster: Cluster, namespace: str, job: str) -> None:
    """End a Job now, keeping it (and its pods' logs) for inspection; delete it if that is refused."""
    try:
        cluster.patch_job(namespace, job, {"spec": {"activeDeadlineSeconds": 1}})
    except ApiException as exc:
        if exc.status != 422:
            raise
        cluster.delete_job(namespace, job, "Background")


def _handle(trigger: str, kwargs: dict[str, Any]) -> None:
    reconcile(
        trigger=trigger,
        body=kwargs["body"],
        name=kwargs["name"],
        namespace=kwargs["namespace"],
        uid=kwargs["uid"],
        spec=kwargs["spec"],
        status=kwargs["status"],
        patch=kwargs["patch"],
        generation=int(kwargs["meta"].get("generation") or 0),
    )


@kopf.on.create(GROUP, VERSION, PLURAL)
def on_create(**kwargs: Any) -> None:
    _handle("create", kwargs)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_update(**kwargs: Any) -> None:
    _handle("update", kwargs)


@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_resume(**kwargs: Any) -> None:
    _handle("resume", kwargs)


@kopf.timer(GROUP, VERSION, PLURAL, interval=POLL_SECONDS, initial_delay=POLL_SECONDS)
def on_timer(**kwargs: Any) -> None:
    _handle("timer", kwargs)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_delete(**kwargs: Any) -> None:
    """Remove the runs' Jobs and pods (foreground, so GPUs are free once this returns). Data is never touched."""
    name, namespace, uid = kwargs["name"], kwargs["namespace"], kwargs["uid"]
    cluster = Cluster()
    owner = Owner(name=name, namespace=namespace, uid=uid)
    jobs = cluster.jobs_of(owner)
    for job in jobs:
        if not job["metadata"].get("deletionTimestamp"):
            cluster.delete_job(namespace, job["metadata"]["name"], "Foreground")
    metrics.record_phase(uid, None)
    if jobs:
        raise kopf.TemporaryError(f"waiting for {len(jobs)} Job(s) and their pods to go", delay=2)
