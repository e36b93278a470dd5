"""Token counts as plain functions, in the commit record and the manifest, checked by verify; the
manifest's capture facts as the reader parses them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.manifest import CAPTURE_KEYS, Capture, ManifestError, build_manifest
from hsx_extractor.storage.store import open_store
from hsx_extractor.storage.stored_json import ShardFormatError
from hsx_extractor.storage.token_counts import (
    add_counts,
    count_masked,
    counts_from_json,
    counts_to_json,
    merge_counts,
)
from hsx_extractor.tools.verify import run_verify
from tests.storage.samples import CAPTURE, finalize_run, plan_for, record, seq_len_of, write_run


def test_count_masked_counts_only_where_the_mask_is_set() -> None:
    ids = np.array([5, 7, 5, 9, 5, 7], dtype=np.int32)
    mask = np.array([1, 1, 0, 1, 1, 0], dtype=np.uint8)
    assert count_masked(ids, mask) == {5: 2, 7: 1, 9: 1}
    assert count_masked(ids, np.zeros(6, np.uint8)) == {}


def test_merge_adds_and_json_round_trips_sorted() -> None:
    a, b = {3: 1, 10: 2}, {10: 5, 1: 4}
    merged = merge_counts([a, b, {}])
    assert merged == {1: 4, 3: 1, 10: 7} and add_counts(dict(a), b) == merged
    stored = counts_to_json(merged)
    assert stored == {"ids": [1, 3, 10], "counts": [4, 1, 7]}
    assert counts_from_json(json.loads(json.dumps(stored))) == merged


@pytest.mark.parametrize(
    "bad",
    [
        {"ids": [3, 1], "counts": [1, 1]},  # not ascending
        {"ids": [1, 1], "counts": [1, 1]},  # repeated
        {"ids": [1], "counts": [0]},  # a zero count is never stored
        {"ids": [1, 2], "counts": [1]},
        {"ids": [-1], "counts": [1]},
        {"ids": [1 << 31], "counts": [1]},  # not an int32 id
        {"ids": [1.0], "counts": [1]},
        {"ids": [1]},
    ],
)
def test_stored_counts_are_checked(bad: dict[str, object]) -> None:
    with pytest.raises(ShardFormatError):
        counts_from_json(bad)


def _root(tmp_path: Path):  # type: ignore[no-untyped-def]
    return open_store(OutputSpec.model_validate({"uri": str(tmp_path), "compression": "none"}), "run-1")


def test_commit_records_and_manifest_carry_the_counts_and_verify_checks_them(tmp_path: Path) -> None:
    store = _root(tmp_path)
    plan = plan_for(12, 5)
    commits = write_run(store, plan, quarantine=frozenset({4}))
    want: Counter[int] = Counter()
    for i in range(12):
        if i != 4:
            rec = record(i, seq_len_of(i))
            want.update(rec.input_ids[rec.loss_mask == 1].tolist())
    assert sum((Counter(c.token_counts) for c in commits), Counter()) == want
    for c in commits:  # the record as stored holds the same counts
        assert ShardCommit.from_bytes((tmp_path / "run-1" / "commits" / f"shard-{c.shard_index:06d}.json").read_bytes()) == c
    manifest = finalize_run(store, {"model": "tiny"})
    assert manifest["capture"] == CAPTURE
    assert counts_from_json(manifest["tokenCounts"]) == want and manifest["tokenCounts"]["total"] == sum(want.values())
    assert run_verify(str(tmp_path / "run-1")).ok

    # A record whose counts disagree with its samples, and a manifest whose counts disagree with the records.
    path = tmp_path / "run-1" / "commits" / "shard-000001.json"
    body = json.loads(path.read_text())
    body["tokenCounts"]["counts"][0] += 1
    path.write_text(json.dumps(body))
    errors = run_verify(str(tmp_path / "run-1")).errors
    assert any("shard 1: token counts in the commit record disagree with its samples" in e for e in errors)
    assert any("'tokenCounts' disagrees with the commit records" in e for e in errors)


def test_a_record_without_counts_makes_the_manifest_counts_null() -> None:
    plain = ShardCommit(0, 1, 0, 8, 8, "k", "0" * 16, 0, 1, (0,))
    counted = ShardCommit(1, 1, 0, 8, 8, "k1", "1" * 16, 1, 2, (1,), token_counts={7: 2})
    assert "tokenCounts" not in plain.to_json()
    assert ShardCommit.from_json(plain.to_json()).token_counts is None
    assert build_manifest("r", "none", [plain, counted], {})["tokenCounts"] is None
    manifest = build_manifest("r", "none", [counted], {"capture": CAPTURE})
    assert manifest["tokenCounts"] == {"ids": [7], "counts": [2], "total": 2}
    assert manifest["capture"] == CAPTURE and manifest["tokenizer"] is None
    with pytest.raises(ValueError, match="not among"):
        build_manifest("r", "none", [counted], {"captureLayers": [1]})


def test_capture_facts_parse_and_name_what_is_missing() -> None:
    capture = Capture.from_json(CAPTURE)
    assert capture.layer_ids == (2, 4, 5) and capture.final_state == "post-norm"
    assert capture.to_json() == CAPTURE and set(CAPTURE) == set(CAPTURE_KEYS)
    partial = {k: v for k, v in CAPTURE.items() if k not in ("finalState", "layerConvention")}
    with pytest.raises(ManifestError, match=r"lacks capture\.layerConvention, capture\.finalState"):
        Capture.from_json(partial)
    with pytest.raises(ManifestError, match="no capture facts"):
        Capture.from_json(None)
    with pytest.raises(ManifestError, match="finalState"):
        Capture.from_json({**CAPTURE, "finalState": "normed"})
    with pytest.raises(ManifestError, match="layerIds"):
        Capture.from_json({**CAPTURE, "layerIds": [2, "4"]})
