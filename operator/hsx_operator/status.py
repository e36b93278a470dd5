"""The ExtractionJob's status as pydantic models, with its phases and reasons (the CRD's status schema).

Written by the operator only, through the status subresource; computed by :mod:`hsx_operator.observe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Phase(StrEnum):
    """Where a run is. Succeeded and Failed are terminal: nothing observed later changes them."""

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class Reason(StrEnum):
    """hsx's own status reasons. A reason may also be Kubernetes' own (ImagePullBackOff, a Job
    condition's reason) when that says best what is wrong."""

    RUN_CREATED = "RunCreated"
    JOB_PENDING = "JobPending"
    JOB_DELETED = "JobDeleted"
    PODS_PENDING = "PodsPending"
    UNSCHEDULABLE = "Unschedulable"
    SERVER_STARTING = "ServerStarting"
    SERVER_CRASH_LOOPING = "ServerCrashLooping"
    # A server container exited before it was ever ready (a crash, OOM, its startup probe's budget spent).
    SERVER_EXITED = "ServerExited"
    STARTUP_DEADLINE_EXCEEDED = "StartupDeadlineExceeded"
    # The run outlived activeDeadlineSeconds (a Job's own condition reason; the operator's for a JobSet).
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    EXTRACTING = "Extracting"
    COMPLETED = "Completed"
    PERMANENT_FAILURE = "PermanentFailure"
    # Permanent failures the extractor names (its termination message's failureReason):
    # most rows failed the dataset checks (validation.maxRejectedRowRate) ...
    DATASET_REJECTED = "DatasetRejected"
    # ... or the captured states disagree with the model's own predictions (validation.consistency).
    CAPTURE_INCONSISTENT = "CaptureInconsistent"
    # The pod's preflight (tokenizer, model config, dataset, output store) failed: no weights were loaded.
    PREFLIGHT_FAILED = "PreflightFailed"
    JOB_FAILED = "JobFailed"
    SUSPENDED = "Suspended"
    # Kueue holds the Job: it carries a queue label and Kueue has a Workload for it.
    QUEUED = "Queued"
    # The Job waits for Kueue (queue label, suspended) but the cluster does not serve Kueue's API.
    KUEUE_NOT_INSTALLED = "KueueNotInstalled"
    # Kueue is installed but has no Workload for the Job (yet: or it does not manage the namespace).
    WAITING_FOR_WORKLOAD = "WaitingForWorkload"
    # The Job is suspended with no queue label while spec.suspend is false: the operator resumes it.
    JOB_SUSPENDED = "JobSuspended"
    INVALID_SPEC = "InvalidSpec"
    # The pod would reach what the cluster admin's policy does not allow (a host path, a system priority class).
    NOT_PERMITTED = "NotPermitted"
    # The API server refused the run's Job (or its ConfigMap) as invalid: a 400 or 422 answer.
    INVALID_JOB_SPEC = "InvalidJobSpec"
    # The API server refused to create the run's Job for another reason (a quota on Jobs, a webhook).
    JOB_CREATE_REFUSED = "JobCreateRefused"
    # The Job controller cannot create pods (FailedCreate on the Job: ResourceQuota, PodSecurity, ...).
    FAILED_CREATE = "FailedCreate"


class _Status(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Condition(_Status):
    """A metav1.Condition."""

    type: str = Field(
        description="Condition type in CamelCase: ServerReady, Reconciling, Stalled, Succeeded, Failed or Suspended.",
        max_length=316,
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    observedGeneration: int = Field(
        default=0, ge=0, description="metadata.generation the condition was computed from."
    )
    lastTransitionTime: str = Field(
        description="When status last changed (RFC 3339).", json_schema_extra={"format": "date-time"}
    )
    reason: str = Field(
        description="CamelCase reason for the last transition.",
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
    )
    message: str = Field(default="", description="Human-readable details.", max_length=32768)


class Progress(_Status):
    """Work done by the run, summed over its pods."""

    samplesTotal: int = Field(default=0, description="Samples in the dataset (after limit).")
    samplesDone: int = Field(
        default=0,
        description="Samples finished: samplesWritten plus samplesQuarantined; equals samplesTotal when the "
        "run is done.",
    )
    samplesWritten: int = Field(default=0, description="Of samplesDone, the samples written to a shard.")
    samplesQuarantined: int = Field(
        default=0, description="Of samplesDone, the samples set aside with a reason instead of written."
    )
    tokensDone: int = Field(default=0, description="Tokens of the samples written.")
    samplesPerSecond: float = Field(default=0.0, description="Current sample rate.")
    tokensPerSecond: float = Field(default=0.0, description="Current token rate.")
    generationDecodeTokensPerSecond: float = Field(
        default=0.0, description="responses: regenerate: tokens generated per second (decode), summed over the pods."
    )
    generationPrefillTokensPerSecond: float = Field(
        default=0.0, description="responses: regenerate: prompt tokens prefilled per second to generate."
    )
    etaSeconds: float | None = Field(
        default=None, description="Estimated seconds until the run is done (the slowest pod)."
    )
    bytesCommitted: int = Field(default=0, description="Bytes of shards committed to the output.")
    shardsCommitted: int = Field(default=0, description="Shards committed to the output.")
    shardsTotal: int = Field(default=0, description="Shards the run will write.")
    shardsLeased: int = Field(
        default=0, description="Shards the running replicas hold a lease on now (being extracted)."
    )
    shards: str = Field(
        default="", description="Shards committed/total, and of the rest how many are leased and how many free."
    )
    planning: bool = Field(
        default=False,
        description="A pod is still reading the dataset to plan its shards (extraction has started): the "
        "totals are the samples read so far and there is no ETA yet.",
    )
    percent: int = Field(
        default=0,
        ge=0,
        le=100,
        description="samplesDone as a percentage of samplesTotal.",
    )
    eta: str = Field(default="", description="etaSeconds, human-readable (1h2m).")
    lastUpdateTime: str | None = Field(
        default=None,
        description="When progress was last read from the extractors.",
        json_schema_extra={"format": "date-time"},
    )


class ReplicaStatus(_Status):
    """The last progress one pod reported (kept after the pod ends, so the sums stay right)."""

    index: int = Field(description="Replica (completion) index.")
    pod: str = Field(default="", description="Name of the pod that reported last.")
    state: str = Field(
        default="", description="The extractor's own state: starting, running, succeeded or failed."
    )
    samplesTotal: int = Field(default=0, description="Samples in the run (shards are leased, not assigned).")
    samplesDone: int = Field(
        default=0, description="Samples of the run finished (written or quarantined), as this replica has seen them."
    )
    samplesWritten: int = Field(default=0, description="Of samplesDone, those written to a shard.")
    samplesQuarantined: int = Field(default=0, description="Of samplesDone, those quarantined.")
    tokensDone: int = Field(default=0, description="Tokens this replica has done.")
    samplesPerSecond: float = Field(default=0.0, description="This replica's sample rate.")
    tokensPerSecond: float = Field(default=0.0, description="This replica's token rate.")
    generationDecodeTokensPerSecond: float = Field(default=0.0, description="This replica's generation decode rate.")
    generationPrefillTokensPerSecond: float = Field(default=0.0, description="This replica's generation prefill rate.")
    etaSeconds: float | None = Field(default=None, description="The run's ETA at this replica's pace alone.")
    bytesCommitted: int = Field(default=0, description="Bytes of the run committed, as this replica has seen them.")
    shardsCommitted: int = Field(default=0, description="Shards of the run committed, as this replica has seen them.")
    shardsTotal: int = Field(default=0, description="Shards in the run's plan.")
    shardsLeased: int = Field(default=0, description="Shards this replica holds a lease on now.")
    planning: bool = Field(
        default=False, description="Still reading the dataset to plan its shards: the totals are so far."
    )
    samplesTotalEstimate: int | None = Field(
        default=None,
        description="While planning: the total the share of the dataset read so far suggests (plain JSONL).",
    )
    lastError: str = Field(default="", description="The extractor's last error, if any.", max_length=4096)


class OutputStatus(_Status):
    """Where this run's data is."""

    prefix: str = Field(default="", description="Output prefix of this run: {output.uri}/{runId}/.")
    manifestUri: str = Field(
        default="", description="URI of the run's manifest, written last when the run succeeds."
    )


class RunRecord(_Status):
    """How an earlier run ended; its data stays under its prefix."""

    runId: str = Field(description="The run's runId.")
    phase: str = Field(description="The phase the run ended in (or Superseded when runId changed mid-run).")
    reason: str = Field(default="", description="Why it ended.")
    jobName: str = Field(default="", description="The run's Job.")
    outputPrefix: str = Field(default="", description="The run's output prefix.")
    startTime: str | None = Field(
        default=None, description="When the run started.", json_schema_extra={"format": "date-time"}
    )
    completionTime: str | None = Field(
        default=None, description="When the run ended.", json_schema_extra={"format": "date-time"}
    )
    samplesDone: int = Field(default=0, description="Samples the run did.")
    samplesWritten: int = Field(default=0, description="Of samplesDone, those written to a shard.")
    samplesQuarantined: int = Field(default=0, description="Of samplesDone, those quarantined.")


class GroupPod(_Status):
    """One pod of a group whose server spans nodes (spec.server.nodes > 1)."""

    name: str = Field(description="The pod.")
    group: int = Field(description="The group (replica) it belongs to.")
    rank: int = Field(description="Its node rank in the group's server: 0 is the leader (server, extractor).")
    phase: str = Field(default="", description="The pod's phase.")
    ready: bool = Field(default=False, description="Whether its server container is ready (rank 0) or running.")


class GroupStatus(_Status):
    """The JobSet of a run whose server spans nodes: its pods and its restarts (a group restarts as one)."""

    jobSet: str = Field(description="Name of the run's JobSet.")
    nodes: int = Field(description="Pods per group (spec.server.nodes).")
    restarts: int = Field(default=0, description="Times the JobSet recreated every group after a pod was lost.")
    lastRestart: str = Field(default="", description="Why the groups last restarted (the failed Job).", max_length=4096)
    lastRestartTime: str | None = Field(default=None, description="When.", json_schema_extra={"format": "date-time"})
    pods: list[GroupPod] = Field(default_factory=list, description="The groups' pods now.")


class ExtractionJobStatus(_Status):
    """What the operator observed. Written by the operator only, through the status subresource."""

    phase: Phase = Field(
        default=Phase.PENDING, description="Pending, Starting, Running, Succeeded, Failed or Suspended."
    )
    observedGeneration: int = Field(
        default=0, description="metadata.generation this status was computed from."
    )
    observedRunId: str = Field(default="", description="runId of the run this status describes.")
    attempt: int = Field(
        default=0, description="Pod attempts so far: 1 for the first, +1 for each retried pod failure."
    )
    startTime: str | None = Field(
        default=None,
        description="When this run's Job was created.",
        json_schema_extra={"format": "date-time"},
    )
    completionTime: str | None = Field(
        default=None, description="When this run ended.", json_schema_extra={"format": "date-time"}
    )
    serverReadyTime: str | None = Field(
        default=None,
        description="When every server of this run first became ready.",
        json_schema_extra={"format": "date-time"},
    )
    reason: str = Field(
        default="", description="Why the run is in its phase (CamelCase), for example ImagePullBackOff."
    )
    message: str = Field(
        default="", description="Details of reason, for example the scheduler's message.", max_length=32768
    )
    jobName: str = Field(default="", description="Name of this run's batch/v1 Job (its JobSet when server.nodes > 1).")
    group: GroupStatus | None = Field(default=None, description="The run's groups of pods, when server.nodes > 1.")
    output: OutputStatus = Field(default_factory=OutputStatus, description="Where this run's data is.")
    progress: Progress = Field(default_factory=Progress, description="Work done, summed over the pods.")
    replicas: list[ReplicaStatus] = Field(default_factory=list, description="Last progress of each replica.")
    history: list[RunRecord] = Field(
        default_factory=list, description="Earlier runs of this resource, newest last (at most 20)."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="ServerReady, Reconciling, Stalled, Succeeded, Failed and Suspended.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


def _pruned(value: Any) -> Any:
    """``value`` as the API server stores it: the status schema has no nullable fields, so a null
    anywhere (inside list items too) is dropped rather than kept."""
    if isinstance(value, Mapping):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def status_patch(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns the stored status into ``wanted``, and nothing else: empty
    when they already agree, so a settled object is never written again. A key whose wanted value
    is null is removed only where it is stored; objects are patched key by key, lists whole."""
    patch: dict[str, Any] = {}
    for key, value in wanted.items():
        old = stored.get(key)
        if value is None:
            if key in stored:
                patch[key] = None
        elif isinstance(value, Mapping) and isinstance(old, Mapping):
            inner = status_patch(old, value)
            if inner:
                patch[key] = inner
        elif _pruned(value) != old:
            patch[key] = _pruned(value)
    return patch
