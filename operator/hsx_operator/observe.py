"""Observations -> status. Pure functions, no I/O.

Input: the spec, the previous status, the run's Job, its pods, their events and what each
extractor's ``/progress`` said (all as plain dicts in Kubernetes' camelCase JSON). Output: the new
status, the Events worth emitting, and whether the run must be stopped (startup deadline).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from hsx_extractor.config import EXIT_PERMANENT, PROGRESS_FIELDS
from hsx_operator.api import (
    TERMINAL_PHASES,
    Condition,
    ExtractionJobSpec,
    ExtractionJobStatus,
    Progress,
    ReplicaStatus,
    RunRecord,
)
from hsx_operator.desired import EXTRACTOR_CONTAINER, SERVER_CONTAINER, job_name, manifest_uri, output_prefix

HISTORY_LIMIT = 20
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
_INT_FIELDS = (
    "samplesTotal",
    "samplesDone",
    "samplesQuarantined",
    "tokensDone",
    "bytesCommitted",
    "shardsCommitted",
    "shardsTotal",
)
_RATE_FIELDS = ("samplesPerSecond", "tokensPerSecond")


def rfc3339(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def human_duration(seconds: float | None) -> str:
    """``3725`` -> ``1h2m``; ``65`` -> ``1m5s``; None -> ``""``."""
    if seconds is None or seconds < 0 or math.isnan(seconds) or math.isinf(seconds):
        return ""
    s = round(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    if minutes:
        return f"{minutes}m{s}s"
    return f"{s}s"


@dataclass(frozen=True)
class EventNote:
    """A Kubernetes Event to emit on the ExtractionJob."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass
class Outcome:
    status: ExtractionJobStatus
    events: list[EventNote] = field(default_factory=list)
    # The run overran startupDeadlineSeconds: end its Job now.
    stop_job: bool = False


# ------------------------------------------------------------------------------------ conditions


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: Literal["True", "False"],
    reason: str,
    message: str,
    generation: int,
    now: datetime,
) -> list[Condition]:
    """Replace one condition; keep lastTransitionTime when its status did not change."""
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type != type_:
            out.append(c)
            continue
        found = True
        since = c.lastTransitionTime if c.status == status else rfc3339(now)
        out.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                observedGeneration=generation,
                lastTransitionTime=since,
            )
        )
    if not found:
        out.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                observedGeneration=generation,
                lastTransitionTime=rfc3339(now),
            )
        )
    return out


def _conditions(
    status: ExtractionJobStatus, stalled: bool, server_ready: bool, generation: int, now: datetime
) -> list[Condition]:
    phase, reason, msg = status.phase, status.reason or status.phase, status.message
    conds = list(status.conditions)

    def put(type_: str, on: bool, why: str, text: str = "") -> None:
        nonlocal conds
        conds = set_condition(conds, type_, "True" if on else "False", why, text, generation, now)

    running = phase in ("Pending", "Starting", "Running")
    put("Reconciling", running, reason if running else phase, msg if running else "")
    put(
        "Stalled",
        stalled or phase == "Failed",
        reason if (stalled or phase == "Failed") else "Progressing",
        msg if stalled or phase == "Failed" else "",
    )
    put("ServerReady", server_ready, "ServerReady" if server_ready else (reason if running else phase))
    put(
        "Succeeded",
        phase == "Succeeded",
        reason if phase == "Succeeded" else phase,
        msg if phase == "Succeeded" else "",
    )
    put("Failed", phase == "Failed", reason if phase == "Failed" else phase, msg if phase == "Failed" else "")
    put("Suspended", phase == "Suspended", reason if phase == "Suspended" else phase)
    return conds


# --------------------------------------------------------------------------------------- runs


def start_run(prior: ExtractionJobStatus, spec: ExtractionJobSpec, xj_name: str) -> ExtractionJobStatus:
    """The status for ``spec.runId``: ``prior`` itself, or a fresh one with ``prior``'s run in history."""
    if prior.observedRunId == spec.runId:
        return prior
    history = list(prior.history)
    if prior.observedRunId:
        ended = prior.phase if prior.phase in TERMINAL_PHASES else "Superseded"
        history.append(
            RunRecord(
                runId=prior.observedRunId,
                phase=ended,
                reason=prior.reason,
                jobName=prior.jobName,
                outputPrefix=prior.output.prefix,
                startTime=prior.startTime,
                completionTime=prior.completionTime,
                samplesDone=prior.progress.samplesDone,
            )
        )
    fresh = ExtractionJobStatus(
        phase="Pending",
        observedRunId=spec.runId,
        jobName=job_name(xj_name, spec.runId),
        reason="RunCreated",
        message=f"run {spec.runId} created",
        history=history[-HISTORY_LIMIT:],
        conditions=prior.conditions,
    )
    fresh.output.prefix = output_prefix(spec)
    fresh.output.manifestUri = manifest_uri(spec)
    return fresh


def needs_job(status: ExtractionJobStatus, job: Mapping[str, Any] | None) -> bool:
    """Create the run's Job only if it never existed: a finished (or lost) run is never started again."""
    return job is None and status.phase not in TERMINAL_PHASES and status.startTime is None


# --------------------------------------------------------------------------------------- pods


def _job_condition(job: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for c in job.get("status", {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c  # type: ignore[no-any-return]
    return None


def _container_status(pod: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
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


def _is_active(pod: Mapping[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Pending", "Running", None) and not pod.get(
        "metadata", {}
    ).get("deletionTimestamp")


def server_ready(pod: Mapping[str, Any]) -> bool:
    cs = _container_status(pod, SERVER_CONTAINER)
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
            return "Unschedulable", f"pod {name}: {c.get('message', '')}".strip()
    for container in (SERVER_CONTAINER, EXTRACTOR_CONTAINER):
        cs = _container_status(pod, container)
        waiting = ((cs or {}).get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason in STUCK_WAITING:
            if reason == "CrashLoopBackOff" and container == SERVER_CONTAINER:
                restarts = (cs or {}).get("restartCount", 0)
                return (
                    "ServerCrashLooping",
                    f"pod {name}: server restarted {restarts} times: {waiting.get('message', '')}".strip(),
                )
            return reason, f"pod {name} container {container}: {waiting.get('message', reason)}"
    if st.get("phase") == "Pending" and not any(
        c.get("type") == "PodScheduled" and c.get("status") == "True" for c in st.get("conditions") or []
    ):
        for ev in reversed(events):
            if ev.get("reason") == "FailedScheduling":
                return "Unschedulable", f"pod {name}: {ev.get('message', '')}"
    return None


def _terminated_progress(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The final progress the extractor left as its termination message (JSON), if any."""
    cs = _container_status(pod, EXTRACTOR_CONTAINER)
    text = (((cs or {}).get("state") or {}).get("terminated") or {}).get("message")
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _exit_summary(pods: Sequence[Mapping[str, Any]]) -> str:
    """Last extractor exit of a failed pod, for the Failed message."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", reverse=True):
        cs = _container_status(pod, EXTRACTOR_CONTAINER)
        term = ((cs or {}).get("state") or {}).get("terminated")
        if term and term.get("exitCode"):
            code = term["exitCode"]
            kind = "permanent failure" if code == EXIT_PERMANENT else "failure"
            final = _terminated_progress(pod)
            if final is not None:
                detail = str(final.get("lastError") or term.get("reason", ""))
            else:
                lines = (term.get("message") or "").strip().splitlines()
                detail = lines[-1] if lines else term.get("reason", "")
            return f"extractor exited {code} ({kind}) in pod {pod['metadata'].get('name')}: {detail}"[:2000]
    return ""


# ----------------------------------------------------------------------------------- progress


def merge_replica(
    prior: ReplicaStatus | None, index: int, pod_name: str, report: Mapping[str, Any]
) -> ReplicaStatus:
    """One replica's status from a /progress report; fields the report lacks keep their last value."""
    base: dict[str, Any] = prior.model_dump() if prior else {"index": index}
    base["index"] = index
    base["pod"] = pod_name
    if "state" in report:
        base["state"] = str(report["state"])
    for key in PROGRESS_FIELDS:
        if key not in report or key not in ReplicaStatus.model_fields:
            continue
        value = report[key]
        if key in _INT_FIELDS:
            base[key] = int(value or 0)
        elif key in _RATE_FIELDS:
            base[key] = float(value or 0.0)
        elif key == "etaSeconds":
            base[key] = None if value is None else float(value)
        elif key == "lastError":
            base[key] = str(value or "")[:4096]
    return ReplicaStatus.model_validate(base)


def aggregate(replicas: Sequence[ReplicaStatus], running: bool, updated: str | None) -> Progress:
    """One progress block for the run: counts summed, ETA of the slowest replica."""
    sums = {k: sum(getattr(r, k) for r in replicas) for k in _INT_FIELDS}
    rates = {k: sum(getattr(r, k) for r in replicas) if running else 0.0 for k in _RATE_FIELDS}
    etas = [
        r.etaSeconds for r in replicas if r.etaSeconds is not None and r.state not in ("succeeded", "failed")
    ]
    eta = max(etas) if etas and running else None
    total = sums["samplesTotal"]
    # The extractor counts a quarantined sample as done (it is finished), so done alone is the progress.
    percent = min(100, sums["samplesDone"] * 100 // total) if total else 0
    return Progress.model_validate(
        {
            **sums,
            **rates,
            "etaSeconds": eta,
            "eta": human_duration(eta),
            "percent": percent,
            "lastUpdateTime": updated,
        }
    )


# -------------------------------------------------------------------------------------- observe


def observe(
    *,
    xj_name: str,
    generation: int,
    spec: ExtractionJobSpec,
    prior: ExtractionJobStatus,
    job: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    events: Mapping[str, Sequence[Mapping[str, Any]]],
    progress: Mapping[str, Mapping[str, Any]],
    now: datetime,
) -> Outcome:
    """The status of the current run. ``events`` and ``progress`` are keyed by pod name."""
    base = start_run(prior, spec, xj_name)
    new_run = base is not prior
    notes: list[EventNote] = []
    if new_run:
        notes.append(
            EventNote("Normal", "RunStarted", f"run {spec.runId} starts; output {base.output.prefix}")
        )

    # Terminal runs are sticky: nothing observed later (a TTL-deleted Job, a resumed spec) changes them.
    if base.phase in TERMINAL_PHASES:
        status = base.model_copy(deep=True)
        status.observedGeneration = generation
        status.conditions = [
            c.model_copy(update={"observedGeneration": generation}) for c in status.conditions
        ]
        return Outcome(status)

    status = base.model_copy(deep=True)
    status.observedGeneration = generation
    status.jobName = job_name(xj_name, spec.runId)
    stalled = False
    all_ready = False
    stop = False

    replicas = {r.index: r for r in status.replicas}
    for pod in pods:
        pname = pod.get("metadata", {}).get("name", "")
        idx = replica_index(pod)
        report = progress.get(pname) or _terminated_progress(pod)
        if report:
            replicas[idx] = merge_replica(replicas.get(idx), idx, pname, report)
    status.replicas = [replicas[i] for i in sorted(replicas)]
    if progress:
        status.progress.lastUpdateTime = rfc3339(now)

    if job is None:
        if status.startTime is not None:
            # It existed for this run and is gone before its end was seen: never start it again.
            status.phase, status.reason = "Failed", "JobDeleted"
            status.message = (
                f"Job {status.jobName} was deleted before the run ended; change runId to run again"
            )
            status.completionTime = rfc3339(now)
        else:
            status.phase, status.reason, status.message = (
                "Pending",
                "JobPending",
                f"creating Job {status.jobName}",
            )
    else:
        jst = job.get("status", {})
        created = job.get("metadata", {}).get("creationTimestamp")
        status.startTime = status.startTime or created or rfc3339(now)
        failures = int(jst.get("failed") or 0)
        status.attempt = 1 + failures
        active = [p for p in pods if _is_active(p)]
        done = _job_condition(job, "Complete") or _job_condition(job, "SuccessCriteriaMet")
        failed = _job_condition(job, "Failed") or _job_condition(job, "FailureTarget")
        if done:
            status.phase, status.reason = "Succeeded", "Completed"
            status.message = (
                f"all {spec.parallelism} replica(s) finished; manifest {status.output.manifestUri}"
            )
            status.completionTime = jst.get("completionTime") or rfc3339(now)
        elif failed:
            status.phase = "Failed"
            # The last failure was not retried: it ended the run.
            status.attempt = max(1, failures)
            reason = failed.get("reason") or "JobFailed"
            status.reason = "PermanentFailure" if reason == "PodFailurePolicy" else reason
            exits = _exit_summary(pods)
            status.message = "; ".join(m for m in (failed.get("message", ""), exits) if m)[:32768]
            status.completionTime = rfc3339(now)
        elif job.get("spec", {}).get("suspend"):
            status.phase = "Suspended"
            if spec.suspend:
                status.reason, status.message = (
                    "Suspended",
                    "suspended by spec.suspend; committed shards are kept",
                )
            else:
                status.reason, status.message = (
                    "Queued",
                    f"waiting for Kueue to admit the Job (queue {spec.scheduling.queueName})",
                )
        else:
            problems = [
                p for p in (pod_problem(pod, events.get(pod["metadata"]["name"], [])) for pod in active) if p
            ]
            ready = [p for p in active if server_ready(p)]
            all_ready = bool(active) and len(ready) == len(active)
            if problems:
                stalled = True
                status.reason, status.message = problems[0]
                status.phase = (
                    "Starting"
                    if any(_scheduled(p) for p in active) and problems[0][0] == "ServerCrashLooping"
                    else "Pending"
                )
            elif not active:
                status.phase, status.reason, status.message = (
                    "Pending",
                    "PodsPending",
                    "waiting for the Job to create pods",
                )
            elif all_ready:
                status.phase, status.reason = "Running", "Extracting"
                p = aggregate(status.replicas, True, None)
                status.message = f"{len(active)} server(s) ready; {p.samplesDone}/{p.samplesTotal} samples"
                status.serverReadyTime = status.serverReadyTime or rfc3339(now)
            else:
                scheduled = [p for p in active if _scheduled(p)]
                status.phase = "Starting" if scheduled else "Pending"
                status.reason = "ServerStarting" if scheduled else "PodsPending"
                status.message = f"{len(ready)}/{len(active)} server(s) ready"
            deadline = spec.startupDeadlineSeconds
            started = parse_time(status.startTime)
            if (
                deadline is not None
                and status.serverReadyTime is None
                and status.phase in ("Pending", "Starting")
                and started is not None
                and (now - started).total_seconds() > deadline
            ):
                why = f" (last: {status.reason}: {status.message})" if status.reason else ""
                status.phase, status.reason = "Failed", "StartupDeadlineExceeded"
                status.message = f"servers not ready within startupDeadlineSeconds={deadline}{why}"[:32768]
                status.completionTime = rfc3339(now)
                stop = True

    terminal = status.phase in TERMINAL_PHASES
    status.progress = aggregate(status.replicas, status.phase == "Running", status.progress.lastUpdateTime)
    status.conditions = _conditions(status, stalled, all_ready and status.phase == "Running", generation, now)
    if (status.phase, status.reason) != (base.phase, base.reason) or new_run:
        warn = stalled or status.phase == "Failed"
        notes.append(
            EventNote(
                "Warning" if warn else "Normal",
                status.reason or status.phase,
                f"{status.phase}: {status.message}"[:1024],
            )
        )
    if terminal and base.phase not in TERMINAL_PHASES:
        status.replicas = [
            r.model_copy(update={"samplesPerSecond": 0.0, "tokensPerSecond": 0.0, "etaSeconds": None})
            for r in status.replicas
        ]
    return Outcome(status, notes, stop)


def _scheduled(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions") or []
    )
