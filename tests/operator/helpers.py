"""Builders of ExtractionJob specs and of the Job/pod JSON the API server returns, for pure tests."""

from __future__ import annotations

from typing import Any

from hsx_operator.api import ExtractionJobSpec


def spec_dict(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "runId": "r1",
        "model": {"path": "/models/tiny", "source": {"hostPath": {"path": "/srv/models"}}},
        "dataset": {"uri": "s3://data/chat.jsonl"},
        "output": {
            "uri": "s3://out/hs",
            "credentialsSecret": "s3-creds",
            "endpoint": "http://127.0.0.1:8333",
        },
    }
    base.update(overrides)
    return base


def make_spec(**overrides: Any) -> ExtractionJobSpec:
    return ExtractionJobSpec.model_validate(spec_dict(**overrides))


def job_json(
    name: str = "xj-r1",
    *,
    conditions: list[dict[str, Any]] | None = None,
    failed: int = 0,
    suspend: bool = False,
    completion_time: str | None = None,
    parallelism: int = 1,
) -> dict[str, Any]:
    status: dict[str, Any] = {"failed": failed, "conditions": conditions or []}
    if not suspend:  # the Job controller's: when it last started running (a resume resets it)
        status["startTime"] = "2026-12-02T10:00:00Z"
    if completion_time:
        status["completionTime"] = completion_time
    return {
        "metadata": {"name": name, "creationTimestamp": "2026-12-02T10:00:00Z"},
        "spec": {"suspend": suspend, "parallelism": parallelism, "completions": parallelism},
        "status": status,
    }


def pod_json(
    name: str = "xj-r1-0-abcde",
    *,
    index: int = 0,
    phase: str = "Running",
    scheduled: bool = True,
    unschedulable_message: str | None = None,
    server: dict[str, Any] | None = None,
    extractor: dict[str, Any] | None = None,
    ip: str = "10.1.0.5",
) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = []
    if unschedulable_message is not None:
        conditions.append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable_message,
            }
        )
    elif scheduled:
        conditions.append({"type": "PodScheduled", "status": "True"})
    status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if server is not None:
        status["initContainerStatuses"] = [{"name": "sglang", **server}]
    if extractor is not None:
        status["containerStatuses"] = [{"name": "extractor", **extractor}]
    if scheduled:
        status["podIP"] = ip
    return {
        "metadata": {
            "name": name,
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
            "creationTimestamp": "2026-12-02T10:00:01Z",
        },
        "status": status,
    }


SERVER_READY = {"started": True, "ready": True, "restartCount": 0, "state": {"running": {}}}
SERVER_LOADING = {"started": False, "ready": False, "restartCount": 0, "state": {"running": {}}}
EXTRACTOR_RUNNING = {"ready": True, "restartCount": 0, "state": {"running": {}}}
EXTRACTOR_WAITING = {"ready": False, "restartCount": 0, "state": {"waiting": {"reason": "PodInitializing"}}}
