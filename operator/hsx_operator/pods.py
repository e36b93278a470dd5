"""What a Job and its pods say, read from their plain camelCase dicts. Pure functions, no I/O."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from hsx_extractor.contract import EXIT_PERMANENT, ProgressReport
from hsx_operator.desired import EXTRACTOR_CONTAINER, PREFLIGHT_CONTAINER, SERVER_CONTAINERS
from hsx_operator.status import Reason

COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# Container waiting reasons that mean the pod cannot start without someone's help.
STUCK_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)
# Pod events of a scheduled pod whose volumes cannot be set up (a missing Secret or ConfigMap, a PVC
# that cannot attach): the kubelet retries, but nothing changes until someone fixes the cause.
STUCK_POD_EVENTS = frozenset({"FailedMount", "FailedAttachVolume"})


def report_from(data: Any) -> ProgressReport | None:
    """An extractor's progress report from its decoded JSON; None when it is not one."""
    if not isinstance(data, Mapping):
        return None
    try:
        return ProgressReport.model_validate(data)
    except ValidationError:
        return None


def parse_report(text: str | bytes) -> ProgressReport | None:
    """An extractor's progress report from its JSON text; None when it is not one."""
    try:
        return report_from(json.loads(text))
    except ValueError:
        return None


def job_finished(job: Mapping[str, Any]) -> bool:
    """The Job controller has ended the Job (Complete or Failed)."""
    return job_condition(job, "Complete") is not None or job_condition(job, "Failed") is not None


def job_condition(job: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for c in job.get("status", {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c  # type: ignore[no-any-return]
    return None


def container_status(pod: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    st = pod.get("status", {})
    for c in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        if c.get("name") == name:
            return c  # type: ignore[no-any-return]
    return None


def replica_index(pod: Mapping[str, Any]) -> int:
    meta = pod.get("metadata", {})
    raw = (meta.get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION) or (meta.get("labels") or {}).get(
        COMPLETION_INDEX_ANNOTATION, "0"
    )
    try:
        return int(raw)
    except ValueError:
        return 0


def is_active(pod: Mapping[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Pending", "Running", None) and not pod.get(
        "metadata", {}
    ).get("deletionTimestamp")


def server_container(pod: Mapping[str, Any]) -> str:
    """The name of the pod's server container (named after its engine)."""
    for name in SERVER_CONTAINERS.values():
        if container_status(pod, name) is not None or any(
            c.get("name") == name for c in (pod.get("spec") or {}).get("initContainers") or []
        ):
            return name
    return SERVER_CONTAINERS["sglang"]


def server_ready(pod: Mapping[str, Any]) -> bool:
    cs = container_status(pod, server_container(pod))
    return bool(cs and cs.get("started") and cs.get("ready") and "running" in (cs.get("state") or {}))


def pod_problem(pod: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """Why a pod cannot make progress: (reason, message), or None."""
    name = pod.get("metadata", {}).get("name", "?")
    st = pod.get("status", {})
    for c in st.get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            return Reason.UNSCHEDULABLE, f"pod {name}: {c.get('message', '')}".strip()
    exited = server_exit_before_ready(pod)
    if exited:
        return Reason.SERVER_EXITED, exited
    server = server_container(pod)
    for container in (PREFLIGHT_CONTAINER, server, EXTRACTOR_CONTAINER):
        cs = container_status(pod, container)
        waiting = ((cs or {}).get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason in STUCK_WAITING:
            if reason == "CrashLoopBackOff" and container == server:
                restarts = (cs or {}).get("restartCount", 0)
                return (
                    Reason.SERVER_CRASH_LOOPING,
                    f"pod {name}: server restarted {restarts} times: {waiting.get('message', '')}".strip(),
                )
            return reason, f"pod {name} container {container}: {waiting.get('message', reason)}"
    if st.get("phase") == "Pending" and not pod_scheduled(pod):
        for ev in reversed(events):
            if ev.get("reason") == "FailedScheduling":
                return Reason.UNSCHEDULABLE, f"pod {name}: {ev.get('message', '')}"
    if st.get("phase") == "Pending" and pod_scheduled(pod) and not _any_container_started(pod):
        for ev in reversed(events):
            if ev.get("reason") in STUCK_POD_EVENTS:
                return str(ev["reason"]), f"pod {name}: {ev.get('message', '')}".strip()
    return None


# How much of a dead server's log the status carries (the kubelet keeps at most 2048 bytes of it).
SERVER_LOG_TAIL_CHARS = 2048


def server_exit_before_ready(pod: Mapping[str, Any]) -> str | None:
    """What ended the pod's server before it was ever ready, or None. The extractor starts only once
    the server's startup probe passed, so a server that exited while the extractor never started
    never served: its exit code and the tail of its log (terminationMessagePolicy
    FallbackToLogsOnError) say why, and the kubelet's restart would load the weights again to fail
    the same way."""
    extractor = container_status(pod, EXTRACTOR_CONTAINER)
    if {"running", "terminated"} & set((extractor or {}).get("state") or {}):
        return None
    server = server_container(pod)
    cs = container_status(pod, server) or {}
    term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
    if not term:
        return None
    reason = term.get("reason") or ""
    tail = (term.get("message") or "").strip()[-SERVER_LOG_TAIL_CHARS:]
    name = pod.get("metadata", {}).get("name", "?")
    text = f"pod {name}: server container {server} exited with code {term.get('exitCode')}"
    text += f" ({reason})" if reason else ""
    text += " before it was ready"
    if int(term.get("exitCode") or 0) == 137 and reason != "OOMKilled":
        text += " (killed: its startup probe failed for server.startupTimeoutSeconds, or the node did)"
    return text + (f"; its log ends:\n{tail}" if tail else "; it left no log")


def _any_container_started(pod: Mapping[str, Any]) -> bool:
    st = pod.get("status", {})
    return any(
        {"running", "terminated"} & set(c.get("state") or {})
        for c in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])
    )


def event_time(event: Mapping[str, Any]) -> str:
    """When an Event (core/v1 view) was last seen, RFC 3339; "" when it says nothing."""
    series = event.get("series") or {}
    return str(
        event.get("lastTimestamp")
        or series.get("lastObservedTime")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or ""
    )


def job_problem(
    job: Mapping[str, Any], events: Sequence[Mapping[str, Any]], active: Sequence[Mapping[str, Any]]
) -> tuple[str, str] | None:
    """Why the Job controller cannot create the run's pods (ResourceQuota, PodSecurity, a missing
    PriorityClass...): the last FailedCreate event on the Job, if it is newer than every active pod
    and the Job still lacks pods. (reason, message), or None."""
    wanted = int(job.get("spec", {}).get("parallelism") or 1)
    if len(active) >= wanted:
        return None
    newest_pod = max((p.get("metadata", {}).get("creationTimestamp") or "" for p in active), default="")
    for ev in sorted(events, key=event_time, reverse=True):
        if ev.get("reason") != "FailedCreate":
            continue
        if event_time(ev) < newest_pod:
            return None
        name = job.get("metadata", {}).get("name", "?")
        kind = job.get("kind") or "Job"
        return Reason.FAILED_CREATE, f"{kind} {name} cannot create its pods: {ev.get('message', '')}".strip()
    return None


@dataclass(frozen=True)
class KueueView:
    """What the cluster says of Kueue for a suspended, queued Job."""

    served: bool  # the cluster serves Kueue's API (kueue.x-k8s.io)
    workloads: tuple[Mapping[str, Any], ...] | None = ()  # the Job's Workloads; None when unreadable


def workload_state(workloads: Sequence[Mapping[str, Any]]) -> str:
    """Kueue's own words on the Job's Workload: evicted, admitted, or why quota is not reserved yet."""
    for wl in workloads:
        conds = {c.get("type"): c for c in wl.get("status", {}).get("conditions") or []}
        for type_, status in (("Evicted", "True"), ("Admitted", "True"), ("QuotaReserved", "False")):
            c = conds.get(type_)
            if c is not None and c.get("status") == status:
                text = c.get("message") or c.get("reason") or ""
                return f"Workload {wl.get('metadata', {}).get('name', '?')} {type_.lower()}: {text}".strip()
    return ""


def terminated_progress(pod: Mapping[str, Any]) -> ProgressReport | None:
    """The final progress the extractor left as its termination message, if it is one."""
    cs = container_status(pod, EXTRACTOR_CONTAINER)
    text = (((cs or {}).get("state") or {}).get("terminated") or {}).get("message")
    return parse_report(text) if text else None


# Permanent failures the extractor names in its termination message (failureReason), as status reasons.
NAMED_FAILURES = {r.value: r for r in (Reason.DATASET_REJECTED, Reason.CAPTURE_INCONSISTENT)}


def named_failure(pods: Sequence[Mapping[str, Any]]) -> Reason | None:
    """The status reason the newest extractor termination message names, if it names a known one."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", reverse=True):
        final = terminated_progress(pod)
        if final is not None and final.failureReason:
            return NAMED_FAILURES.get(final.failureReason)
    return None


def last_exit(pods: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """(container, summary) of the newest failed exit of the preflight or extractor container."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", reverse=True):
        for container in (PREFLIGHT_CONTAINER, EXTRACTOR_CONTAINER):
            cs = container_status(pod, container)
            term = ((cs or {}).get("state") or {}).get("terminated")
            if not (term and term.get("exitCode")):
                continue
            code = term["exitCode"]
            kind = "permanent failure" if code == EXIT_PERMANENT else "failure"
            final = terminated_progress(pod) if container == EXTRACTOR_CONTAINER else None
            if final is not None:
                detail = str(final.lastError or term.get("reason", ""))
            else:
                lines = (term.get("message") or "").strip().splitlines()
                detail = lines[-1] if lines else term.get("reason", "")
            summary = f"{container} exited {code} ({kind}) in pod {pod['metadata'].get('name')}: {detail}"
            return container, summary[:2000]
    return None



def pod_scheduled(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions") or []
    )


def scale_patch(job: Mapping[str, Any], parallelism: int) -> dict[str, Any] | None:
    """The patch that gives a running Job ``parallelism`` pods, or None when it has them. Completions move
    with it (an elastic Indexed Job keeps completions == parallelism): indexes past the new count are
    removed by the Job controller, and their extractors release their shard leases on SIGTERM."""
    spec = job.get("spec", {})
    if spec.get("parallelism") == parallelism and spec.get("completions") == parallelism:
        return None
    return {"spec": {"completions": parallelism, "parallelism": parallelism}}
