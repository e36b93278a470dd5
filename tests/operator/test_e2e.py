"""The operator on the real control plane and node agent, with the real extractor and the CPU reference server."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.operator.conftest import HSX, OperatorProcess, wait_for
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def ns(xj_crd: Any, namespace: str, request: pytest.FixtureRequest, node_agent: Any) -> Iterator[Namespace]:
    space = Namespace(xj_crd, namespace)
    yield space
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        # What the run looked like when the test gave up.
        for xj in space.items("xj"):
            print(f"--- xj {xj['metadata']['name']} status ---\n{json.dumps(xj.get('status'), indent=1)}")
        for pod in space.items("pods"):
            print(f"--- pod {pod['metadata']['name']} ---\n{json.dumps(pod.get('status'), indent=1)[:3000]}")
            for c in ("sglang", "extractor"):
                print(f"--- {c} log ---\n{node_agent.logs(namespace, pod['metadata']['name'], c)[-3000:]}")


@pytest.fixture
def run_env(
    hsx_node: Any, tiny_model: Path, chat_dataset: Path, op_workdir: Path, namespace: str
) -> dict[str, Any]:
    out = op_workdir / "out" / namespace
    return {"model_root": tiny_model.parent, "dataset": chat_dataset, "output": out}


def verify(output_run_dir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [HSX, "verify", "--json", str(output_run_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def phase(ns: Namespace, name: str, *phases: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        st = ns.status(name)
        return st if st.get("phase") in phases else None

    return check


def progressed(ns: Namespace, name: str) -> Callable[[], dict[str, Any] | None]:
    """Status once some samples are done (or the run failed: no point waiting)."""

    def check() -> dict[str, Any] | None:
        st = ns.status(name)
        done = (st.get("progress") or {}).get("samplesDone", 0)
        return st if done > 0 or st.get("phase") == "Failed" else None

    return check


def test_full_run_reaches_succeeded_and_verifies(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    op = start_operator()
    ns.apply(xj_manifest("full", "r1", **run_env))
    job = wait_for(lambda: ns.get("job", "full-r1"), 60, "the Job")
    assert job["metadata"]["ownerReferences"][0]["kind"] == "ExtractionJob"
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
