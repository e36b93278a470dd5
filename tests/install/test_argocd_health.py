"""The Argo CD health check (docs/argocd-health.lua), run by a real Lua 5.1 interpreter.

Argo CD evaluates health scripts with gopher-lua, a Lua 5.1; lupa embeds the reference Lua 5.1.
The script runs in an environment holding only what Argo CD's sandbox also offers, plus ``obj``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

lua51 = pytest.importorskip("lupa.lua51")

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "argocd-health.lua"
ARGO_STATUSES = {"Healthy", "Degraded", "Suspended", "Progressing", "Missing", "Unknown"}


def run_health(obj: dict[str, Any]) -> dict[str, str]:
    lua = lua51.LuaRuntime()
    chunk = lua.execute("return loadstring")(SCRIPT.read_text(), "argocd-health.lua")
    assert chunk is not None, "the script does not compile under Lua 5.1"
    env = lua.table_from(
        {"ipairs": lua.globals().ipairs, "pairs": lua.globals().pairs, "tostring": lua.globals().tostring}
    )
    env["obj"] = lua.table_from(obj, recursive=True)
    lua.globals().setfenv(chunk, env)
    result = chunk()
    return {str(k): str(v) for k, v in result.items()}


def job(phase: str | None, generation: int = 3, observed: int | None = 3, **status: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"phase": phase, **status} if phase is not None else dict(status)
    if observed is not None:
        body["observedGeneration"] = observed
    return {
        "apiVersion": "hsx.dev/v1alpha1",
        "kind": "ExtractionJob",
        "metadata": {"name": "demo", "namespace": "ml", "generation": generation},
        "status": body,
    }


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        ("Succeeded", "Healthy"),
        ("Failed", "Degraded"),
        ("Suspended", "Suspended"),
        ("Pending", "Progressing"),
        ("Running", "Progressing"),
        ("Resuming", "Progressing"),
        ("SomethingNew", "Progressing"),
    ],
)
def test_phase_maps_to_argo_status(phase: str, expected: str) -> None:
    assert run_health(job(phase))["status"] == expected


def test_no_status_yet_is_progressing() -> None:
    obj = job(None)
    del obj["status"]
    health = run_health(obj)
    assert health["status"] == "Progressing"
    assert "operator" in health["message"]


@pytest.mark.parametrize("phase", ["Succeeded", "Failed", "Suspended"])
def test_status_of_an_older_generation_is_progressing(phase: str) -> None:
    # runId changed in Git: generation 4, the operator still reports on generation 3.
    health = run_health(job(phase, generation=4, observed=3))
    assert health["status"] == "Progressing"
    assert "generation 4" in health["message"]


def test_missing_observed_generation_is_progressing() -> None:
    assert run_health(job("Succeeded", observed=None))["status"] == "Progressing"


def test_message_comes_from_the_phase_condition() -> None:
    conditions = [
        {"type": "Running", "status": "False", "reason": "Finished", "message": "stale"},
        {"type": "Failed", "status": "True", "reason": "MismatchGate", "message": "mismatch rate 5% > 2%"},
    ]
    health = run_health(job("Failed", conditions=conditions, message="fallback"))
    assert health == {"status": "Degraded", "message": "mismatch rate 5% > 2%"}


def test_message_falls_back_to_status_message_then_phase() -> None:
    assert run_health(job("Running", message="120/400 samples"))["message"] == "120/400 samples"
    assert run_health(job("Running"))["message"] == "Phase Running"


@given(
    phase=st.one_of(
        st.none(), st.sampled_from(["Succeeded", "Failed", "Suspended", "Running"]), st.text(max_size=12)
    ),
    generation=st.integers(min_value=1, max_value=2**40),
    lag=st.integers(min_value=-2, max_value=2),
)
def test_healthy_only_when_succeeded_and_current(phase: str | None, generation: int, lag: int) -> None:
    observed = max(generation - lag, 0)
    health = run_health(job(phase, generation=generation, observed=observed))
    assert health["status"] in ARGO_STATUSES
    current = observed >= generation
    assert (health["status"] == "Healthy") == (current and phase == "Succeeded")
    assert (health["status"] == "Degraded") == (current and phase == "Failed")
