"""The operator on the real control plane and node agent, with the real extractor and the CPU reference server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import missing_from, phase, progressed, rendered, verify
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_full_run_reaches_succeeded_and_verifies(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess], tmp_path: Path
) -> None:
    op = start_operator()
    manifest = xj_manifest("full", "r1", **run_env)
    ns.apply(manifest)
    job = wait_for(lambda: ns.get("job", "full-r1"), 60, "the Job")
    assert job["metadata"]["ownerReferences"][0]["kind"] == "ExtractionJob"
    # `hsx render -f` shows what the operator creates: the API server only adds its defaults.
    want_config, want_job = rendered(ns, manifest, tmp_path)
    assert missing_from(job["spec"], want_job["spec"]) == []
    assert missing_from(job["metadata"]["labels"], want_job["metadata"]["labels"]) == []
    created_config = ns.get("configmap", want_config["metadata"]["name"])
    assert created_config is not None and created_config["data"] == want_config["data"]
    running = wait_for(phase(ns, "full", "Running", "Succeeded", "Failed"), 180, "Running")
    assert running["phase"] != "Failed", running
    moving = wait_for(progressed(ns, "full"), 180, "progress")
    assert moving["phase"] != "Failed", moving
    done = wait_for(phase(ns, "full", "Succeeded", "Failed"), 300, "the run to end")
    assert done["phase"] == "Succeeded", (done, op.tail())
    assert moving["progress"]["samplesTotal"] > 0
    report = verify(run_env["output"] / "r1")
    assert report.get("ok", True)
    reasons = ns.event_reasons("full")
    assert "RunStarted" in reasons and "JobCreated" in reasons and "Completed" in reasons, reasons
    conds = {c["type"]: c["status"] for c in done["conditions"]}
    assert conds["Succeeded"] == "True" and conds["Reconciling"] == "False" and conds["Stalled"] == "False"
    table = ns.kubectl("get", "xj", "full", "-o", "wide").stdout
    assert "Succeeded" in table and "r1" in table
