"""What the operator and the extractor agree on: exit codes and the progress report.

The extractor writes a :class:`ProgressReport` (GET /progress, and once more as the container's
termination message when it ends); the operator reads the same model. Nothing here imports
numpy, aiohttp or anything of a run, so the operator image can import it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Exit codes of `hsx extract`; the operator's podFailurePolicy reads them.
EXIT_OK = 0
# Worth retrying: server died, S3 flaked past retries, pod evicted.
EXIT_TRANSIENT = 1
# Retrying cannot help: invalid config, tokenizer mismatch, mismatch gate tripped, S3 access denied.
EXIT_PERMANENT = 3

# The dataset's own S3 credentials (dataset.credentialsSecret) reach the extractor under these
# names, so they never mix with the output's AWS_* chain.
DATASET_CREDENTIALS_ENV = (
    "HSX_DATASET_AWS_ACCESS_KEY_ID",
    "HSX_DATASET_AWS_SECRET_ACCESS_KEY",
    "HSX_DATASET_AWS_SESSION_TOKEN",
)

ExtractorState = Literal["starting", "running", "succeeded", "failed"]
# Kubernetes keeps at most this many bytes of a termination message.
TERMINATION_MESSAGE_LIMIT = 4096


class ProgressReport(BaseModel):
    """One extractor's progress: the body of GET /progress and of the termination message.

    Counts cover the whole run as this process has seen it (shards are leased, and it counts the shards
    other processes commit): samples of shards committed before a restart or by others count as done;
    tokens, rates and shardsLeased are this process's own work.
    """

    model_config = ConfigDict(extra="ignore")

    samplesTotal: int = 0
    # Finished samples: written to a shard (samplesWritten) or quarantined (samplesQuarantined);
    # done = written + quarantined.
    samplesDone: int = 0
    samplesWritten: int = 0
    samplesQuarantined: int = 0
    tokensDone: int = 0
    samplesPerSecond: float = 0.0
    tokensPerSecond: float = 0.0
    etaSeconds: float | None = None
    bytesCommitted: int = 0
    shardsCommitted: int = 0
    shardsTotal: int = 0
    # The plan is still being made while extracting: the totals are the rows read so far, no ETA yet.
    planning: bool = False
    # While planning: the total the rows placed so far and the share of the dataset read suggest (plain
    # JSONL, by bytes); None when unknown. Progress and ETA use it until the plan gives the real total.
    samplesTotalEstimate: int | None = None
    requestsInFlight: int = 0
    # Shards this process holds a live lease on (run/leases.py): what it is working on now.
    shardsLeased: int = 0
    lastError: str | None = None
    # Why a failed run stopped, when it has a name of its own (DatasetRejected, CaptureInconsistent): the
    # operator's status reason.
    failureReason: str | None = None
    state: ExtractorState = "starting"
    runId: str = ""
    replicaIndex: int = 0
    quarantinedByReason: dict[str, int] = Field(default_factory=dict)
    # The consistency check (validation.consistency): requests checked and how many disagreed.
    consistencyChecked: int = 0
    consistencyFailed: int = 0
    # responses: regenerate: rows this process generated; its decode and prefill pace for them (tokens/s).
    samplesGenerated: int = 0
    generationDecodeTokensPerSecond: float = 0.0
    generationPrefillTokensPerSecond: float = 0.0

    def termination_message(self, limit: int = TERMINATION_MESSAGE_LIMIT) -> str:
        """Compact JSON within ``limit`` bytes: per-reason counts and a long error are cut first."""
        text = self.model_dump_json()
        if len(text.encode()) <= limit:
            return text
        cut = self.model_copy(
            update={"quarantinedByReason": {}, "lastError": (self.lastError or "")[:1024] or self.lastError}
        )
        return cut.model_dump_json(exclude={"quarantinedByReason"})


# The counters an operator copies from a report into its status (names as in ProgressReport).
PROGRESS_COUNTERS = (
    "samplesTotal",
    "samplesDone",
    "samplesWritten",
    "samplesQuarantined",
    "tokensDone",
    "bytesCommitted",
    "shardsCommitted",
    "shardsTotal",
)
PROGRESS_RATES = ("samplesPerSecond", "tokensPerSecond", "generationDecodeTokensPerSecond",
                  "generationPrefillTokensPerSecond")
# Flags a progress report carries beside its counters.
PROGRESS_FLAGS = ("planning",)
# What a replica holds now, summed over the replicas still running.
PROGRESS_GAUGES = ("shardsLeased",)
# Counters every process reports for the whole run (the largest report is the run's); the rest of
# PROGRESS_COUNTERS is each process's own work (summed).
RUN_WIDE_COUNTERS = tuple(k for k in PROGRESS_COUNTERS if k != "tokensDone")


def merge_reports(reports: list[ProgressReport]) -> ProgressReport:
    """The reports of several processes of one pod (extractor workers) as one: the largest run-wide
    counts, summed work, pace and what is held now; failed if any failed, running while any runs."""
    if not reports:
        return ProgressReport()
    largest = max(reports, key=lambda r: (r.samplesDone, r.samplesQuarantined))
    merged = largest.model_copy()
    for key in RUN_WIDE_COUNTERS:
        setattr(merged, key, max(getattr(r, key) for r in reports))
    for key in ("tokensDone", "samplesGenerated", *PROGRESS_RATES, *PROGRESS_GAUGES, "requestsInFlight"):
        setattr(merged, key, sum(getattr(r, key) for r in reports))
    merged.consistencyChecked = max(r.consistencyChecked for r in reports)
    merged.consistencyFailed = max(r.consistencyFailed for r in reports)
    states = {r.state for r in reports}
    merged.state = next(s for s in ("failed", "running", "starting", "succeeded") if s in states)
    failed = [r for r in reports if r.state == "failed"]
    merged.lastError = next((r.lastError for r in failed + reports if r.lastError), None)
    merged.failureReason = next((r.failureReason for r in failed if r.failureReason), None)
    merged.planning = any(r.planning for r in reports)
    left = max(merged.samplesTotal - merged.samplesDone, 0)
    merged.etaSeconds = round(left / merged.samplesPerSecond, 1) if merged.samplesPerSecond > 0 else None
    return merged
