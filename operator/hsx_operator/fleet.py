"""The run's progress from its replicas' reports: each replica reports the whole run as it has seen it
(shards are leased, not assigned), so the run's counts are the largest report and its pace the sum.
Pure functions on the status models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hsx_extractor.contract import (
    PROGRESS_COUNTERS,
    PROGRESS_FLAGS,
    PROGRESS_GAUGES,
    PROGRESS_RATES,
    RUN_WIDE_COUNTERS,
    ProgressReport,
)
from hsx_operator.conditions import human_duration
from hsx_operator.status import Progress, ReplicaStatus


def merge_replica(
    prior: ReplicaStatus | None, index: int, pod_name: str, report: ProgressReport
) -> ReplicaStatus:
    """One replica's status from a progress report; fields the report lacks keep their last value."""
    base: dict[str, Any] = prior.model_dump() if prior else {"index": index}
    base["index"] = index
    base["pod"] = pod_name
    given = report.model_fields_set
    for key in ("state", *PROGRESS_COUNTERS, *PROGRESS_RATES, *PROGRESS_FLAGS, *PROGRESS_GAUGES, "etaSeconds",
                "samplesTotalEstimate"):  # fmt: skip
        if key in given:
            base[key] = getattr(report, key)
    if "lastError" in given:
        base["lastError"] = (report.lastError or "")[:4096]
    if "samplesWritten" not in given and "samplesDone" in given:
        # An extractor from before samplesWritten: what it finished and did not quarantine was written.
        base["samplesWritten"] = max(base["samplesDone"] - base.get("samplesQuarantined", 0), 0)
    return ReplicaStatus.model_validate(base)


def aggregate(replicas: Sequence[ReplicaStatus], running: bool, updated: str | None) -> Progress:
    """One progress block for the run: the largest run-wide counts, the summed work and pace, and the
    ETA of what is left at the fleet's pace."""
    counts: dict[str, Any] = {k: max((getattr(r, k) for r in replicas), default=0) for k in RUN_WIDE_COUNTERS}
    counts["tokensDone"] = sum(r.tokensDone for r in replicas)
    rates = {k: sum(getattr(r, k) for r in replicas) if running else 0.0 for k in PROGRESS_RATES}
    active = [r for r in replicas if r.state not in ("succeeded", "failed")]
    gauges = {k: sum(getattr(r, k) for r in active) if running else 0 for k in PROGRESS_GAUGES}
    left = max(counts["shardsTotal"] - counts["shardsCommitted"], 0)
    shards = f"{counts['shardsCommitted']}/{counts['shardsTotal']}" + (
        f" ({min(gauges['shardsLeased'], left)} leased, {max(left - gauges['shardsLeased'], 0)} free)" if left else ""
    ) if counts["shardsTotal"] else ""
    planning = running and any(r.planning for r in active)
    # While planning, progress is against the estimated total (by bytes read), so it does not jump ahead
    # of the truth; no ETA while a planning replica cannot estimate it.
    total = max((max(r.samplesTotal, r.samplesTotalEstimate or 0) if r.planning else r.samplesTotal
                 for r in replicas), default=0)  # fmt: skip
    blind = any(r.planning and r.samplesTotalEstimate is None for r in active)
    pace = rates["samplesPerSecond"]
    eta = round(max(total - counts["samplesDone"], 0) / pace, 1) if running and pace > 0 and not blind else None
    # The extractor counts a quarantined sample as done (it is finished), so done alone is the progress.
    percent = min(100, counts["samplesDone"] * 100 // total) if total else 0
    return Progress.model_validate(
        {
            **counts,
            **rates,
            **gauges,
            "shards": shards,
            "etaSeconds": eta,
            "eta": human_duration(eta),
            "percent": percent,
            "planning": planning,
            "lastUpdateTime": updated,
        }
    )
