"""Nothing that is mostly rejected rows ends Succeeded (issue 33, item 6): the rejection gate, pure and in a real run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT, ProgressReport
from hsx_extractor.reasons import SERVER_REASONS
from hsx_extractor.run.runner import extract
from hsx_extractor.run.validate import REJECTION_GATE_MIN_SAMPLES, rejection_verdict
from hsx_extractor.storage.commit_record import QuarantineEntry
from tests.run.helpers import RefServer, base_config, chat_rows, write_jsonl


def test_the_gate_counts_dataset_reasons_only_and_waits_for_enough_samples_before_the_end() -> None:
    few = {"invalid_json": 6, "too_long": 3}
    assert rejection_verdict(few, 10, 0.5, final=False) is None  # early: too few samples to judge
    verdict = rejection_verdict(few, 10, 0.5, final=True, examples=[QuarantineEntry(2, None, "invalid_json", "bad", 3)])
    assert verdict is not None and verdict.startswith("DatasetRejected: 9 of 10 samples (90.0%)")
    assert "invalid_json 6, too_long 3" in verdict and "line 3 (invalid_json): bad" in verdict
    assert rejection_verdict(few, 18, 0.5, final=True) is None  # 9 of 18 is not more than half
    assert rejection_verdict({r.value: 10 for r in SERVER_REASONS}, 10, 0.0, final=True) is None
    many = {"empty_messages": REJECTION_GATE_MIN_SAMPLES}
    assert rejection_verdict(many, REJECTION_GATE_MIN_SAMPLES, 0.5, final=False) is not None
    assert rejection_verdict(many, REJECTION_GATE_MIN_SAMPLES, 1.0, final=True) is None  # 1 turns it off
    assert rejection_verdict({}, 0, 0.0, final=True) is None


@pytest.mark.slow
def test_a_run_of_rejected_rows_fails_with_its_reason_and_writes_no_manifest(
    tmp_path: Path, ref_server: RefServer
) -> None:
    rows = [*chat_rows(2), *(["not json"] * 5), *({"id": f"e{i}", "messages": []} for i in range(3))]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    term = tmp_path / "termination-log"
    cfg = ExtractConfig.model_validate(base_config(tmp_path, ref_server, dataset, terminationMessagePath=str(term)))
    code, result = asyncio.run(extract(cfg))
    assert (code, result) == (EXIT_PERMANENT, None)
    final = ProgressReport.model_validate_json(term.read_text())
    assert final.failureReason == "DatasetRejected" and final.state == "failed"
    assert final.lastError is not None and "8 of 10 samples (80.0%)" in final.lastError
    assert "invalid_json 5, empty_messages 3" in final.lastError and "line 3 (invalid_json)" in final.lastError
    assert not (tmp_path / "out" / "run" / "manifest.json").exists()
    # Allowed by the setting, the same rows make a run that succeeds with what it could keep.
    allowed = ExtractConfig.model_validate(
        base_config(tmp_path, ref_server, dataset, run_id="allowed", validation__maxRejectedRowRate=1.0)
    )
    code, result = asyncio.run(extract(allowed))
    assert code == EXIT_OK and result is not None
    manifest = json.loads((tmp_path / "out" / "allowed" / "manifest.json").read_text())
    assert (manifest["samples"], manifest["quarantined"]) == (2, 8)
