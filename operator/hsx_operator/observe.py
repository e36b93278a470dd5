"""Observations -> status. Pure functions, no I/O.

Input: the spec, the previous status, the run's Job, its pods, their events and what each
extractor's ``/progress`` said (all as plain dicts in Kubernetes' camelCase JSON). Output: the new
status, the Events worth emitting, and whether the run must be stopped (startup deadline, a server that
exited before it was ready).
:func:`observe` picks the situation the run is in; one small function per situation sets the phase.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hsx_extractor.contract import PROGRESS_RATES
from hsx_extractor.sglang_hook.launch import DETERMINISTIC_FLAG, seed_ignored
from hsx_operator.api import ExtractionJobSpec
from hsx_operator.conditions import conditions_for, parse_time, rfc3339
from hsx_operator.desired import LABEL_QUEUE, PREFLIGHT_CONTAINER, job_name, manifest_uri, output_prefix
from hsx_operator.fleet import aggregate, merge_replica
from hsx_operator.pods import (
    KueueView,
    is_active,
    job_condition,
    job_problem,
    last_exit,
    named_failure,
    pod_problem,
    pod_scheduled,
    replica_index,
    report_from,
    server_ready,
    terminated_progress,
    workload_state,
)
from hsx_operator.status import (
    TERMINAL_PHASES,
    ExtractionJobStatus,
    Phase,
    Reason,
    RunRecord,
)

HISTORY_LIMIT = 20


@dataclass(frozen=True)
class EventNote:
    """A Kubernetes Event to emit on the ExtractionJob."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Refusal:
    """The run's Job was not created: the API server refused it, or the spec cannot make one.

    ``permanent`` refusals (an invalid spec, a Job the API server calls invalid) fail the run;
    the others (a quota on Jobs, a webhook that is down) leave it Pending and stalled, retried."""

    reason: str
    message: str
    permanent: bool


@dataclass
class Outcome:
    status: ExtractionJobStatus
    events: list[EventNote] = field(default_factory=list)
    # The run overran startupDeadlineSeconds, or its server exited before it was ready: end its Job now.
    stop_job: bool = False


# --------------------------------------------------------------------------------------- runs


def start_run(prior: ExtractionJobStatus, spec: ExtractionJobSpec, xj_name: str) -> ExtractionJobStatus:
    """The status for ``spec.runId``: ``prior`` itself, or a fresh one with ``prior``'s run in history."""
    if prior.observedRunId == spec.runId:
        return prior
    history = list(prior.history)
    if prior.observedRunId:
        ended = str(prior.phase) if prior.phase in TERMINAL_PHASES else "Superseded"
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
                samplesWritten=prior.progress.samplesWritten,
                samplesQuarantined=prior.progress.samplesQuarantined,
            )
        )
    fresh = ExtractionJobStatus(
        phase=Phase.PENDING,
        observedRunId=spec.runId,
        jobName=job_name(xj_name, spec.runId),
        reason=Reason.RUN_CREATED,
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


# -------------------------------------------------------------------------------------- observe


@dataclass
class _Seen:
    """What observing the pods adds to the phase: a stuck pod, all servers ready, a run to stop."""

    stalled: bool = False
    all_ready: bool = False
    stop: bool = False


def _set(status: ExtractionJobStatus, phase: Phase, reason: str, message: str) -> None:
    status.phase, status.reason, status.message = phase, reason, message


def _without_job(status: ExtractionJobStatus, now: datetime, refusal: Refusal | None) -> _Seen:
    if status.startTime is not None:
        # It existed for this run and is gone before its end was seen: never start it again.
        _set(
            status,
            Phase.FAILED,
            Reason.JOB_DELETED,
            f"Job {status.jobName} was deleted before the run ended; change runId to run again",
        )
        status.completionTime = rfc3339(now)
    elif refusal is not None and refusal.permanent:
        _set(status, Phase.FAILED, refusal.reason, refusal.message[:32768])
        status.completionTime = rfc3339(now)
    elif refusal is not None:
        _set(status, Phase.PENDING, refusal.reason, refusal.message[:32768])
        return _Seen(stalled=True)
    else:
        _set(status, Phase.PENDING, Reason.JOB_PENDING, f"creating Job {status.jobName}")
    return _Seen()


def _completed(
    status: ExtractionJobStatus, spec: ExtractionJobSpec, job: Mapping[str, Any], now: datetime
) -> None:
    message = f"all {spec.parallelism} replica(s) finished; manifest {status.output.manifestUri}"
    _set(status, Phase.SUCCEEDED, Reason.COMPLETED, message)
    status.completionTime = job.get("status", {}).get("completionTime") or rfc3339(now)


def _failed(
    status: ExtractionJobStatus,
    condition: Mapping[str, Any],
    failures: int,
    pods: Sequence[Mapping[str, Any]],
    now: datetime,
) -> None:
    # The last failure was not retried: it ended the run.
    status.attempt = max(1, failures)
    reason = condition.get("reason") or Reason.JOB_FAILED
    exited = last_exit(pods)
    message = "; ".join(m for m in (condition.get("message", ""), exited[1] if exited else "") if m)[:32768]
    if exited and exited[0] == PREFLIGHT_CONTAINER:
        reason = Reason.PREFLIGHT_FAILED  # nothing reached the server: the message says what to fix
    elif reason == "PodFailurePolicy":
        reason = named_failure(pods) or Reason.PERMANENT_FAILURE
    _set(status, Phase.FAILED, reason, message)
    status.completionTime = rfc3339(now)


def _suspended(
    status: ExtractionJobStatus, spec: ExtractionJobSpec, job: Mapping[str, Any], kueue: KueueView | None
) -> bool:
    """A suspended Job: by spec.suspend, or held by Kueue (only when Kueue really has it). Stalled?"""
    name = f'{job.get("kind") or "Job"} {job.get("metadata", {}).get("name", status.jobName)}'
    queue = (job.get("metadata", {}).get("labels") or {}).get(LABEL_QUEUE)
    if spec.suspend:
        _set(
            status, Phase.SUSPENDED, Reason.SUSPENDED, "suspended by spec.suspend; committed shards are kept"
        )
    elif not queue:
        _set(
            status,
            Phase.SUSPENDED,
            Reason.JOB_SUSPENDED,
            f"{name} is suspended though spec.suspend is false and it names no Kueue queue; resuming it",
        )
    elif kueue is None or not kueue.served:
        _set(
            status,
            Phase.SUSPENDED,
            Reason.KUEUE_NOT_INSTALLED,
            f"{name} waits for Kueue to admit it (queue {queue}), but this cluster does not serve Kueue's "
            "API (kueue.x-k8s.io): install Kueue, or run without scheduling.queueName under a new runId",
        )
        return True
    elif kueue.workloads is not None and not kueue.workloads:
        _set(
            status,
            Phase.SUSPENDED,
            Reason.WAITING_FOR_WORKLOAD,
            f"{name} waits for Kueue to create its Workload (queue {queue}); if this lasts, Kueue does not "
            "manage this namespace or this kind (a JobSet needs jobset.x-k8s.io/jobset in Kueue's integrations.frameworks)",
        )
    else:
        said = workload_state(kueue.workloads or ())
        _set(
            status,
            Phase.SUSPENDED,
            Reason.QUEUED,
            f"Kueue holds {name} in queue {queue}" + (f"; {said}" if said else ""),
        )
    return False


def _active(
    status: ExtractionJobStatus,
    job: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    events: Mapping[str, Sequence[Mapping[str, Any]]],
    job_events: Sequence[Mapping[str, Any]],
    now: datetime,
) -> _Seen:
    """A run whose Job neither ended nor is suspended: pods pending, servers starting, or extracting."""
    seen = _Seen()
    active = [p for p in pods if is_active(p)]
    problems = [p for p in (pod_problem(pod, events.get(pod["metadata"]["name"], [])) for pod in active) if p]
    uncreated = job_problem(job, job_events, active)
    if uncreated:
        problems.insert(0, uncreated)
    ready = [p for p in active if server_ready(p)]
    seen.all_ready = bool(active) and len(ready) == len(active)
    exited = next((p for p in problems if p[0] == Reason.SERVER_EXITED), None)
    if exited:  # fail now: the kubelet's restart would load the weights to fail the same way
        _set(status, Phase.FAILED, *exited)
        status.completionTime = rfc3339(now)
        seen.stop = True
    elif problems:
        seen.stalled = True
        reason, message = problems[0]
        crash_looping = any(pod_scheduled(p) for p in active) and reason == Reason.SERVER_CRASH_LOOPING
        _set(status, Phase.STARTING if crash_looping else Phase.PENDING, reason, message)
    elif not active:
        _set(status, Phase.PENDING, Reason.PODS_PENDING, "waiting for the Job to create pods")
    elif seen.all_ready:
        p = aggregate(status.replicas, True, None)
        done = (
            f"{p.samplesDone}/{p.samplesTotal} samples ({p.samplesWritten} written, "
            f"{p.samplesQuarantined} quarantined)"
            + ("; planning: the dataset is still being read, the total so far" if p.planning else "")
            if p.samplesTotal
            else "planning the run"
        )
        message = f"{len(active)} server(s) ready; {done}"
        _set(status, Phase.RUNNING, Reason.EXTRACTING, message)
        status.serverReadyTime = status.serverReadyTime or rfc3339(now)
    else:
        scheduled = any(pod_scheduled(p) for p in active)
        _set(
            status,
            Phase.STARTING if scheduled else Phase.PENDING,
            Reason.SERVER_STARTING if scheduled else Reason.PODS_PENDING,
            f"{len(ready)}/{len(active)} server(s) ready",
        )
    return seen


def _past_startup_deadline(
    status: ExtractionJobStatus, spec: ExtractionJobSpec, job: Mapping[str, Any], now: datetime
) -> bool:
    """Servers not ready within startupDeadlineSeconds of the Job's start (its admission, for a run Kueue
    held: not its time in the queue): fail the run (the caller stops its Job)."""
    deadline = spec.startupDeadlineSeconds
    started = parse_time(job.get("status", {}).get("startTime"))
    if (
        deadline is None
        or status.serverReadyTime is not None
        or status.phase not in (Phase.PENDING, Phase.STARTING)
        or started is None
        or (now - started).total_seconds() <= deadline
    ):
        return False
    why = f" (last: {status.reason}: {status.message})" if status.reason else ""
    message = f"servers not ready within startupDeadlineSeconds={deadline}{why}"[:32768]
    _set(status, Phase.FAILED, Reason.STARTUP_DEADLINE_EXCEEDED, message)
    status.completionTime = rfc3339(now)
    return True


def _past_group_deadline(
    status: ExtractionJobStatus, spec: ExtractionJobSpec, job: Mapping[str, Any], now: datetime
) -> bool:
    """A JobSet running longer than activeDeadlineSeconds since it started: fail the run (the caller deletes
    it). A Job keeps its own deadline; a JobSet's Jobs carry none, as each restart would start it again."""
    deadline = spec.activeDeadlineSeconds
    started = parse_time(job.get("status", {}).get("startTime"))
    if job.get("kind") != "JobSet" or deadline is None or started is None:
        return False
    if (now - started).total_seconds() <= deadline:
        return False
    restarts = f", {status.group.restarts} restart(s)" if status.group and status.group.restarts else ""
    message = f"JobSet {job['metadata'].get('name', '')} ran past activeDeadlineSeconds={deadline}{restarts}"
    _set(status, Phase.FAILED, Reason.DEADLINE_EXCEEDED, message + "; committed shards are kept")
    status.completionTime = rfc3339(now)
    return True


def _with_job(
    status: ExtractionJobStatus,
    spec: ExtractionJobSpec,
    job: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    events: Mapping[str, Sequence[Mapping[str, Any]]],
    job_events: Sequence[Mapping[str, Any]],
    kueue: KueueView | None,
    now: datetime,
) -> _Seen:
    jst = job.get("status", {})
    status.startTime = status.startTime or job.get("metadata", {}).get("creationTimestamp") or rfc3339(now)
    failures = int(jst.get("failed") or 0)
    status.attempt = 1 + failures
    failed = job_condition(job, "Failed") or job_condition(job, "FailureTarget")
    if job_condition(job, "Complete") or job_condition(job, "SuccessCriteriaMet"):
        _completed(status, spec, job, now)
    elif failed:
        _failed(status, failed, failures, pods, now)
    elif job.get("spec", {}).get("suspend"):
        return _Seen(stalled=_suspended(status, spec, job, kueue))
    else:
        seen = _active(status, job, pods, events, job_events, now)
        seen.stop = seen.stop or _past_startup_deadline(status, spec, job, now) or _past_group_deadline(status, spec, job, now)
        return seen
    return _Seen()


_NO_PACE: dict[str, Any] = {**dict.fromkeys(PROGRESS_RATES, 0.0), "etaSeconds": None}


def _merge_reports(
    status: ExtractionJobStatus, pods: Sequence[Mapping[str, Any]], progress: Mapping[str, Mapping[str, Any]]
) -> None:
    """Each pod's report (polled, or its termination message) into its replica's status.

    Rates and ETA are the extractor's pace now: only a report polled in this reconcile carries them.
    A replica not polled (pod restarting, replaced, finished, unreachable) shows 0 and no ETA rather
    than the last pace it had, which may be hours old."""
    replicas = {r.index: r for r in status.replicas}
    fresh: set[int] = set()
    for pod in pods:
        pname = pod.get("metadata", {}).get("name", "")
        idx = replica_index(pod)
        polled = progress.get(pname)
        report = report_from(polled) if polled else terminated_progress(pod)
        if report:
            replicas[idx] = merge_replica(replicas.get(idx), idx, pname, report)
            if polled:
                fresh.add(idx)
    status.replicas = [
        replicas[i] if i in fresh else replicas[i].model_copy(update=_NO_PACE) for i in sorted(replicas)
    ]


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
    job_events: Sequence[Mapping[str, Any]] = (),
    refusal: Refusal | None = None,
    kueue: KueueView | None = None,
) -> Outcome:
    """The status of the current run. ``events`` and ``progress`` are keyed by pod name;
    ``job_events`` are the Job's own; ``refusal`` says why the run's Job could not be created;
    ``kueue`` is what the cluster says of Kueue when the Job waits for it (None: Kueue not served)."""
    base = start_run(prior, spec, xj_name)
    new_run = base is not prior
    notes: list[EventNote] = []
    if new_run:
        notes.append(
            EventNote("Normal", "RunStarted", f"run {spec.runId} starts; output {base.output.prefix}")
        )
        if (seed := spec.generation.seed) is not None and spec.responses == "regenerate" and (
            spec.server.engine == "sglang" and seed_ignored(spec.server.extraArgs)
        ):
            notes.append(EventNote("Warning", "SeedIgnored", f"generation.seed {seed} is not applied: SGLang samples with "
                                   f"a request's seed only when started with {DETERMINISTIC_FLAG} (server.extraArgs)"))  # fmt: skip

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
    status.jobName = job["metadata"]["name"] if job else job_name(xj_name, spec.runId)
    _merge_reports(status, pods, progress)
    if progress:
        status.progress.lastUpdateTime = rfc3339(now)
    if job is None:
        seen = _without_job(status, now, refusal)
    else:
        seen = _with_job(status, spec, job, pods, events, job_events, kueue, now)

    terminal = status.phase in TERMINAL_PHASES
    status.progress = aggregate(status.replicas, status.phase == Phase.RUNNING, status.progress.lastUpdateTime)
    status.progress.percent = max(status.progress.percent, base.progress.percent)  # never backwards in a run
    status.conditions = conditions_for(
        status, seen.stalled, seen.all_ready and status.phase == Phase.RUNNING, generation, now
    )
    quarantined = status.progress.samplesQuarantined
    if quarantined and not base.progress.samplesQuarantined:
        # Said once, when the first sample is set aside: each one's reason and line are in the output.
        notes.append(
            EventNote(
                "Warning",
                "SamplesQuarantined",
                f"{quarantined} sample(s) quarantined so far; each one's reason and line are in the run's "
                "commit records and, at the end, manifest.json",
            )
        )
    if status.phase == Phase.SUCCEEDED and quarantined and "quarantined" not in status.message:
        status.message = f"{status.message}; {quarantined} sample(s) quarantined (listed in the manifest)"
    if (status.phase, status.reason) != (base.phase, base.reason) or new_run:
        warn = seen.stalled or status.phase == Phase.FAILED
        notes.append(
            EventNote(
                "Warning" if warn else "Normal",
                status.reason or status.phase,
                f"{status.phase}: {status.message}"[:1024],
            )
        )
    if terminal and base.phase not in TERMINAL_PHASES:
        status.replicas = [r.model_copy(update=_NO_PACE) for r in status.replicas]
    return Outcome(status, notes, seen.stop)
