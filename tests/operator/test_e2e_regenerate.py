"""responses: regenerate through the operator on the real control plane and node agent: the ExtractionJob's
spec reaches each pod's extractor config, the server (the CPU reference server, which generates) writes the
answers, and the run ends Succeeded with its generations stored beside its shards."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.reasons import GENERATION_REASONS
from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tiny_model
from hsx_operator.desired import config_map_name
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import phase, verify
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
ROWS = 12


def test_a_regenerating_job_stores_its_generations_and_succeeds(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess], op_workdir: Path
) -> None:
    op = start_operator()
    # A model whose head speaks whole words (what it generates re-renders to its ids), under /models/tiny.
    models = op_workdir / "speaking-models"
    if not (models / "tiny").exists():
        build_tiny_model(models / "tiny", TinyModelSpec(spoken_words=12))
    data = op_workdir / "regen-data"
    data.mkdir(exist_ok=True)
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i} alpha beta?"}]} for i in range(ROWS)]
    (data / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_env["output"]  # owned by the extractor's user (run_env)
    manifest = xj_manifest(
        "regen", "g1", model_root=models, dataset=data / "prompts.jsonl", output=out,
        responses="regenerate", generation={"temperature": 1.0, "seed": 3, "maxNewTokens": 48},
    )  # fmt: skip
    ns.apply(manifest)
    config = wait_for(lambda: ns.get("configmap", config_map_name("regen", "g1")), 60, "the extractor config")
    text = next(iter(config["data"].values()))
    assert "responses: regenerate" in text and "seed: 3" in text, text
    done = wait_for(phase(ns, "regen", "Succeeded", "Failed"), 300, "the run to end")
    assert done["phase"] == "Succeeded", (done, op.tail())
    assert done["progress"]["samplesDone"] == ROWS
    report = verify(out / "g1")
    assert report.get("ok", True) and report["samples"] + report["quarantined"] == ROWS, report
    stored = [json.loads(line) for p in sorted((out / "g1" / "generations").glob("*.jsonl"))
              for line in p.read_text().splitlines()]  # fmt: skip
    assert sorted(r["id"] for r in stored) == sorted(r["id"] for r in rows)
    assert all(r.get("quarantine", {}).get("reason", next(iter(GENERATION_REASONS))) in GENERATION_REASONS
               for r in stored)  # fmt: skip
    manifest_json = json.loads((out / "g1" / "manifest.json").read_text())
    assert manifest_json["run"]["responses"]["generation"]["seed"] == 3
