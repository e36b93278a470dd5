"""The consistency check in whole runs against the real reference server: a correct capture passes
and says so in every commit record and the manifest; captures of the wrong state (pre-norm labelled
post-norm, one layer short, a tensor-parallel partial sum) fail the run early with
CaptureInconsistent; a rate of bad captures under the limit is tolerated and listed by index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.config import OutputSpec
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.storage.store import open_store

from .helpers import RefServer, base_config, chat_rows, write_jsonl
from .test_pipeline import run


def commits(cfg: dict[str, Any]) -> list[Any]:
    store = open_store(OutputSpec.model_validate(cfg["output"]), cfg["runId"])
    out = [store.get_commit(k) for k in sorted(store.committed_shards())]
    assert all(c is not None for c in out)
    return out


def test_a_correct_capture_passes_and_the_record_says_what_was_checked(tmp_path: Path, ref_server: RefServer) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40, words=30))
    cfg = base_config(tmp_path, ref_server, data, validation__consistency={"samplesPerShard": 3})
    code, result, progress = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None, progress.last_error
    records = commits(cfg)
    assert len(records) >= 2  # several shards, each with its own checks
    for c in records:
        assert c.consistency is not None and len(c.consistency["checked"]) == 3 and c.consistency["failed"] == []
        assert set(c.consistency["checked"]) <= set(c.sample_indices)
        assert c.consistency["maxLogprobError"] < 0.005  # fp32 server, bf16 capture: see docs/consistency.md
        norms = c.layer_norms
        assert norms is not None and len(norms["aux"]) == 3 and norms["final"]["tokens"] > 0
    report = progress.report()
    assert report.consistencyChecked == 3 * len(records) and report.consistencyFailed == 0
    manifest = result.manifest
    assert manifest["capture"]["finalState"] == "post-norm" and manifest["run"]["consistency"]["topK"] == 5
    assert all("consistency" in s and "layerNorms" in s for s in manifest["shards"])
    # The tiny model's final norm has unit weights: the final state's token norm is about sqrt(H).
    final = records[0].layer_norms["final"]
    assert 6.0 < final["mean"] < 10.0, final


@pytest.mark.parametrize("fault", ["prenorm", "wrong_layer", "partial_sum"])
def test_a_wrong_capture_fails_the_run_early_with_capture_inconsistent(
    tmp_path: Path, ref_server: RefServer, fault: str
) -> None:
    ref_server.set_fault(fault)
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(80, words=30))
    cfg = base_config(tmp_path, ref_server, data, validation__consistency={"samplesPerShard": 6})
    code, result, progress = run(cfg)
    assert code == EXIT_PERMANENT and result is None
    report = progress.report()
    assert report.state == "failed" and (report.lastError or "").startswith("CaptureInconsistent:"), report.lastError
    assert report.consistencyFailed >= 4 and report.consistencyFailed == report.consistencyChecked
    assert report.samplesDone < report.samplesTotal  # early: not after the whole dataset
    assert not (tmp_path / "out" / "run" / "manifest.json").exists()
    # What the operator shows: the termination message carries the typed failure and the counts.
    final = json.loads(progress.termination_message())
    assert final["lastError"].startswith("CaptureInconsistent:") and final["consistencyFailed"] >= 4


def test_bad_captures_under_the_limit_are_tolerated_and_listed(tmp_path: Path, ref_server: RefServer) -> None:
    ref_server.set_fault("prenorm", every=4)  # samples 0, 4, 8, ... are captured pre-norm
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40, words=30))
    cfg = base_config(
        tmp_path, ref_server, data, validation__consistency={"samplesPerShard": 40, "maxFailureRate": 0.5}
    )
    code, result, progress = run(cfg)
    assert code == EXIT_OK and result is not None, progress.last_error
    checked = [i for c in commits(cfg) for i in c.consistency["checked"]]
    failed = [i for c in commits(cfg) for i in c.consistency["failed"]]
    assert sorted(checked) == list(range(40))
    assert failed == [i for i in range(40) if i % 4 == 0]  # exactly the spoiled ones


def test_the_check_fails_a_run_with_a_wrong_capture_at_its_end_too(tmp_path: Path, ref_server: RefServer) -> None:
    # Fewer checks than minChecks: judged when the last shard is in, before the manifest.
    ref_server.set_fault("wrong_layer")
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(6, words=30))
    cfg = base_config(tmp_path, ref_server, data, validation__consistency={"samplesPerShard": 2})
    code, _, progress = run(cfg)
    assert code == EXIT_PERMANENT and (progress.last_error or "").startswith("CaptureInconsistent: 2 of 2")
    assert not (tmp_path / "out" / "run" / "manifest.json").exists()


def test_without_readable_weights_the_default_check_is_off_and_the_manifest_says_so(
    tmp_path: Path, ref_server: RefServer
) -> None:
    model = tmp_path / "config-only"
    model.mkdir()
    for f in ref_server.model.iterdir():  # everything but the weights
        if f.is_file() and f.suffix != ".safetensors":
            (model / f.name).write_bytes(f.read_bytes())
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    cfg = base_config(tmp_path, ref_server, data, modelPath=str(model))
    code, result, _ = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    assert "no lm_head" in result.manifest["run"]["consistency"]["off"]
    asked = base_config(tmp_path / "b", ref_server, data, modelPath=str(model), validation__consistency={"samplesPerShard": 1})
    code, _, progress = run(asked)
    assert code == EXIT_PERMANENT and "validation.consistency" in (progress.last_error or "")
