"""status.status_patch: the merge patch from the stored status to the computed one (plain dicts)."""

from __future__ import annotations

from typing import Any

from hsx_operator.status import ExtractionJobStatus, ReplicaStatus, status_patch


def stored_after(stored: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """What the API server keeps after a JSON merge patch (RFC 7386) of a schema without nullables."""
    out = dict(stored)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = stored_after(out[key], value)
        elif isinstance(value, dict):
            out[key] = stored_after({}, value)
        else:
            out[key] = value
    return out


def test_nulls_in_the_computed_status_settle_after_one_patch() -> None:
    # etaSeconds is null in the model and absent once stored: the old top-level diff re-sent it forever.
    status = ExtractionJobStatus(
        phase="Succeeded",  # type: ignore[arg-type]
        replicas=[ReplicaStatus(index=0, samplesDone=3, etaSeconds=None)],
    )
    wanted = status.model_dump(mode="json")
    first = status_patch({}, wanted)
    assert "etaSeconds" not in first["replicas"][0]
    assert "etaSeconds" not in first["progress"]
    stored = stored_after({}, first)
    assert status_patch(stored, wanted) == {}


def test_a_nested_value_that_became_null_is_removed_and_nothing_else_is_sent() -> None:
    stored = {"phase": "Running", "progress": {"etaSeconds": 12.0, "samplesDone": 5, "eta": "12s"}}
    wanted = {"phase": "Running", "progress": {"etaSeconds": None, "samplesDone": 5, "eta": ""}}
    patch = status_patch(stored, wanted)
    assert patch == {"progress": {"etaSeconds": None, "eta": ""}}
    assert stored_after(stored, patch) == {"phase": "Running", "progress": {"samplesDone": 5, "eta": ""}}


def test_a_top_level_null_not_stored_is_not_sent_and_a_stored_one_is_removed() -> None:
    assert status_patch({"phase": "Running"}, {"phase": "Running", "completionTime": None}) == {}
    assert status_patch({"completionTime": "x"}, {"completionTime": None}) == {"completionTime": None}


def test_lists_are_sent_whole_when_an_item_changes() -> None:
    stored = {"replicas": [{"index": 0, "samplesDone": 1}, {"index": 1, "samplesDone": 2}]}
    wanted = {"replicas": [{"index": 0, "samplesDone": 1, "etaSeconds": None}, {"index": 1, "samplesDone": 3}]}
    assert status_patch(stored, wanted) == {
        "replicas": [{"index": 0, "samplesDone": 1}, {"index": 1, "samplesDone": 3}]
    }
