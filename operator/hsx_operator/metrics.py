"""Prometheus metrics of the operator (served by ``hsx-operator --metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from hsx_operator.status import Phase

RECONCILES = Counter(
    "hsx_operator_reconciles_total",
    "Reconciliations of ExtractionJobs, by trigger and result.",
    ["trigger", "result"],
)
ERRORS = Counter("hsx_operator_errors_total", "Failed API calls or progress polls, by kind.", ["kind"])
JOBS_CREATED = Counter("hsx_operator_jobs_created_total", "batch/v1 Jobs created for runs.")
RECONCILE_SECONDS = Histogram("hsx_operator_reconcile_seconds", "Time one reconciliation took.")
JOBS_BY_PHASE = Gauge(
    "hsx_operator_extractionjobs", "ExtractionJobs seen by this operator, by phase.", ["phase"]
)

_phase_of: dict[str, str] = {}


def record_phase(uid: str, phase: str | None) -> None:
    """Remember one object's phase (None: it is gone) and refresh the per-phase gauge."""
    if phase is None:
        _phase_of.pop(uid, None)
    else:
        _phase_of[uid] = phase
    for p in Phase:
        JOBS_BY_PHASE.labels(phase=p.value).set(sum(1 for v in _phase_of.values() if v == p))
