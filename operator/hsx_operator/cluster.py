"""The operator's cluster I/O: the few API calls it makes and the extractors' /progress poll.

Everything returns plain camelCase dicts, the input of the pure functions in observe/desired.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import kopf
import kubernetes
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from hsx_operator import metrics
from hsx_operator.desired import EXTRACTOR_CONTAINER, LABEL_XJ, Owner, label_value
from hsx_operator.group import JOBSET_GROUP, JOBSET_NAME_LABEL, JOBSET_PLURAL, JOBSET_VERSION
from hsx_operator.observe import Refusal
from hsx_operator.pods import KueueView
from hsx_operator.status import Reason

KUEUE_GROUP = "kueue.x-k8s.io"
# Kueue labels each Workload with the uid of the Job it stands for.
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
log = logging.getLogger("hsx_operator")

# One poll of an extractor's /progress, all of it (connect, headers, body): a pod can only slow the
# operator's reconcile by this much. The body is a few hundred bytes; anything past the cap is refused.
PROGRESS_TIMEOUT = 2.0
PROGRESS_MAX_BYTES = 1 << 20
# One wide run's slow pods (64 pods x 2 s) must not hold the operator's workers: every run's polls
# share these threads, and one reconcile waits at most POLL_BUDGET_SECONDS (the rest answer next time).
POLL_WORKERS = 16
POLL_BUDGET_SECONDS = 5.0
_POLLS = ThreadPoolExecutor(max_workers=POLL_WORKERS, thread_name_prefix="hsx-progress")


class ProgressPollError(Exception):
    """The pod's /progress answer was refused: not 200, too big, too slow, or not a JSON object."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def server_clock(date_header: str | None, seen_at: float, now_monotonic: float) -> datetime | None:
    """The API server's time now, from the ``Date`` header of a response received at monotonic
    ``seen_at`` (1 s resolution); None without a usable header."""
    if not date_header:
        return None
    try:
        stamped = parsedate_to_datetime(date_header)
    except (TypeError, ValueError):
        return None
    if stamped.tzinfo is None:
        return None
    return stamped.astimezone(UTC) + timedelta(seconds=max(0.0, now_monotonic - seen_at))


class Cluster:
    """The few API calls the operator makes, returning plain camelCase dicts.

    Times compared with the cluster's own timestamps (a Job's creationTimestamp against
    startupDeadlineSeconds) use :meth:`now`, the API server's clock: a skewed operator node must
    neither fail a run early nor let a stuck one run on."""

    def __init__(self) -> None:
        self.core = kubernetes.client.CoreV1Api()
        self.batch = kubernetes.client.BatchV1Api()
        self.custom = kubernetes.client.CustomObjectsApi()
        self._date: tuple[str, float] | None = None

    def now(self) -> datetime:
        """The API server's time as of the last response; this machine's before any."""
        seen = server_clock(*self._date, time.monotonic()) if self._date else None
        return seen or datetime.now(UTC)

    def _json(self, response: Any) -> Any:
        date = response.headers.get("Date") if getattr(response, "headers", None) is not None else None
        if date:
            self._date = (date, time.monotonic())
        return json.loads(response.data)

    def jobs_of(self, owner: Owner) -> list[dict[str, Any]]:
        got = self._json(
            self.batch.list_namespaced_job(
                owner.namespace, label_selector=f"{LABEL_XJ}={label_value(owner.name)}", _preload_content=False
            )
        )
        return [
            j
            for j in got["items"]
            if any(r.get("uid") == owner.uid for r in j["metadata"].get("ownerReferences") or [])
        ]

    def jobsets_of(self, owner: Owner) -> list[dict[str, Any]]:
        """The owner's JobSets (runs whose server spans nodes); none where JobSet is not installed."""
        try:
            selector = f"{LABEL_XJ}={label_value(owner.name)}"
            listed = self.custom.list_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, owner.namespace, JOBSET_PLURAL, label_selector=selector,
                _preload_content=False,
            )  # fmt: skip
            got = self._json(listed)
        except ApiException as exc:
            if exc.status not in (403, 404):  # not installed, or not granted: no run of this owner is one
                raise
            return []
        return [
            j
            for j in got["items"]
            if any(r.get("uid") == owner.uid for r in j["metadata"].get("ownerReferences") or [])
        ]

    def create_or_read(self, owner: Owner, manifest: dict[str, Any], kind: str) -> dict[str, Any]:
        ns, name = owner.namespace, manifest["metadata"]["name"]
        jobset = (JOBSET_GROUP, JOBSET_VERSION, ns, JOBSET_PLURAL)
        create: Any = {
            "Job": self.batch.create_namespaced_job,
            "JobSet": lambda ns_, body, **kw: self.custom.create_namespaced_custom_object(*jobset, body, **kw),
        }.get(kind, self.core.create_namespaced_config_map)
        read: Any = {
            "Job": self.batch.read_namespaced_job,
            "JobSet": lambda name_, ns_, **kw: self.custom.get_namespaced_custom_object(*jobset, name_, **kw),
        }.get(kind, self.core.read_namespaced_config_map)
        try:
            return self._json(create(ns, manifest, _preload_content=False))  # type: ignore[no-any-return]
        except ApiException as exc:
            if exc.status != 409:
                raise
        existing = self._json(read(name, ns, _preload_content=False))
        if not any(r.get("uid") == owner.uid for r in existing["metadata"].get("ownerReferences") or []):
            raise kopf.TemporaryError(
                f"{kind} {name} exists but belongs to another object; waiting for it to go", delay=5
            )
        return existing  # type: ignore[no-any-return]

    def pods_of(self, namespace: str, job: str, kind: str = "Job") -> list[dict[str, Any]]:
        """The pods of a Job, or of every Job of a JobSet."""
        label = JOBSET_NAME_LABEL if kind == "JobSet" else "batch.kubernetes.io/job-name"
        got = self._json(
            self.core.list_namespaced_pod(namespace, label_selector=f"{label}={job}", _preload_content=False)
        )
        return got["items"]  # type: ignore[no-any-return]

    def events_of(self, namespace: str, name: str, kind: str = "Pod") -> list[dict[str, Any]]:
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        got = self._json(
            self.core.list_namespaced_event(namespace, field_selector=selector, _preload_content=False)
        )
        return sorted(got["items"], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def kueue_view(self, namespace: str, job_uid: str) -> KueueView:
        """Whether the cluster serves Kueue's API and, if so, the Job's Workloads (by Kueue's job-uid
        label, in the group's preferred version). Workloads the operator may not read are None."""
        groups = self._json(kubernetes.client.ApisApi().get_api_versions(_preload_content=False))
        group = next((g for g in groups.get("groups") or [] if g.get("name") == KUEUE_GROUP), None)
        if group is None:
            return KueueView(served=False)
        version = group["preferredVersion"]["version"]
        try:
            got = self._json(
                kubernetes.client.CustomObjectsApi().list_namespaced_custom_object(
                    KUEUE_GROUP,
                    version,
                    namespace,
                    "workloads",
                    label_selector=f"{KUEUE_JOB_UID_LABEL}={job_uid}",
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status not in (403, 404):
                raise
            log.warning("cannot list Kueue Workloads in %s: %s", namespace, api_message(exc))
            return KueueView(served=True, workloads=None)
        return KueueView(served=True, workloads=tuple(got.get("items") or []))

    def patch_job(self, namespace: str, name: str, body: dict[str, Any], kind: str = "Job") -> None:
        if kind == "JobSet":
            self.custom.patch_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name, body
            )
        else:
            self.batch.patch_namespaced_job(name, namespace, body)

    def delete_job(self, namespace: str, name: str, propagation: str, kind: str = "Job") -> None:
        try:
            if kind == "JobSet":
                self.custom.delete_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name, propagation_policy=propagation
                )
            else:
                self.batch.delete_namespaced_job(name, namespace, propagation_policy=propagation)
        except ApiException as exc:
            if exc.status != 404:
                raise


def api_message(exc: ApiException) -> str:
    """The API server's own words from an error answer (its Status message), else the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return f"HTTP {exc.status} {exc.reason or ''}".strip()


def create_refusal(exc: ApiException, kind: str, name: str) -> Refusal | None:
    """A 4xx answer to creating the run's Job or ConfigMap as a :class:`Refusal`; None for answers
    that are not about the object (throttling, authentication): those are retried as errors."""
    if exc.status is None or not 400 <= exc.status < 500 or exc.status in (401, 408, 409, 429):
        return None
    said = api_message(exc)
    if exc.status in (400, 422):
        return Refusal(
            Reason.INVALID_JOB_SPEC,
            f"the API server rejected {kind} {name} (HTTP {exc.status}): {said}; fix the ExtractionJob's "
            "spec and change runId to run again",
            permanent=True,
        )
    return Refusal(
        Reason.JOB_CREATE_REFUSED,
        f"the API server refused to create {kind} {name} (HTTP {exc.status}): {said}; retrying",
        permanent=False,
    )


# The spec field behind what the pod template passes through as given, for messages.
_PASSED_THROUGH = {
    "affinity": "spec.scheduling.affinity",
    "tolerations": "spec.scheduling.tolerations",
    "nodeSelector": "spec.scheduling.nodeSelector",
}


def client_refusal(exc: ValidationError, kind: str, name: str) -> Refusal:
    """The Kubernetes client's own check of an object before sending it (its models are pydantic)
    as a permanent :class:`Refusal`: no request was made, so the API server's 422 never comes."""
    said = []
    for error in exc.errors()[:5]:
        path = [str(p) for p in error.get("loc", ())[1:]]  # the first entry is the argument's position
        where = ".".join(path)
        field = next((f for key, f in _PASSED_THROUGH.items() if key in path), None)
        said.append(f"{where}: {error.get('msg', 'invalid')}" + (f" (from {field})" if field else ""))
    return Refusal(
        Reason.INVALID_JOB_SPEC,
        f"{kind} {name} is invalid: {'; '.join(said)}; fix the ExtractionJob's spec and change runId to run again",
        permanent=True,
    )


def fetch_progress(
    host: str, port: int, timeout: float = PROGRESS_TIMEOUT, max_bytes: int = PROGRESS_MAX_BYTES
) -> dict[str, Any]:
    """GET http://{host}:{port}/progress as a JSON object, or raise :class:`ProgressPollError`.

    Anyone who can run a pod chooses what its port answers, so: redirects are not followed (the
    operator must never be steered to another address, such as a metadata service), at most
    ``max_bytes`` of body are read, and the whole exchange ends at ``timeout`` seconds however
    slowly the bytes trickle (a watchdog shuts the socket at the deadline).
    """
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    watchdog: threading.Timer | None = None
    try:
        conn.connect()
        sock = conn.sock

        def cut() -> None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), cut)
        watchdog.daemon = True
        watchdog.start()
        conn.request("GET", "/progress", headers={"Accept": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ProgressPollError(f"HTTP {resp.status} (redirects are not followed)")
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
            raise ProgressPollError(f"body of {declared} bytes exceeds {max_bytes}")
        body = bytearray()
        while chunk := resp.read1(65536):
            body += chunk
            if len(body) > max_bytes:
                raise ProgressPollError(f"body exceeds {max_bytes} bytes")
        if time.monotonic() >= deadline:
            raise ProgressPollError(f"no complete answer within {timeout:g}s")
        if resp.length:  # Content-Length bytes still missing: the peer closed early
            raise ProgressPollError("body ended early")
        report = json.loads(bytes(body), parse_constant=_refuse_constant)
    except (OSError, http.client.HTTPException, ValueError, RecursionError) as exc:
        if time.monotonic() >= deadline:
            raise ProgressPollError(f"no complete answer within {timeout:g}s") from exc
        raise ProgressPollError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if watchdog is not None:
            watchdog.cancel()
        conn.close()
    if not isinstance(report, dict):
        raise ProgressPollError(f"answer is a JSON {type(report).__name__}, not an object")
    return report


def poll_progress(pod: Mapping[str, Any], port: int, run_id: str) -> dict[str, Any] | None:
    ip = pod.get("status", {}).get("podIP")
    states = {
        c.get("name"): c.get("state") or {} for c in pod.get("status", {}).get("containerStatuses") or []
    }
    if not ip or "running" not in states.get(EXTRACTOR_CONTAINER, {}):
        return None
    try:
        report = fetch_progress(ip, port)
    except ProgressPollError:
        metrics.ERRORS.labels(kind="progress").inc()
        return None
    if report.get("runId", run_id) != run_id:
        return None
    return report


def poll_pods(
    pods: Sequence[Mapping[str, Any]], port: int, run_id: str, budget: float = POLL_BUDGET_SECONDS
) -> dict[str, dict[str, Any]]:
    """The reports of the pods that answered within ``budget`` seconds, by pod name; polls not yet
    started then are cancelled, so a run's round never outlasts its budget nor leaves work queued."""
    futures = {p["metadata"]["name"]: _POLLS.submit(poll_progress, p, port, run_id) for p in pods}
    done, _ = wait(futures.values(), timeout=budget)
    reports = {}
    for name, future in futures.items():
        if future not in done:
            future.cancel()
        elif (report := future.result()) is not None:
            reports[name] = report
    return reports
