"""Rendering the hsx chart with the real helm, for the chart tests."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.ground.tools import tool_path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "hsx"
CRDS = ROOT / "crds"


def helm(
    *args: str, check: bool = True, kubeconfig: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    argv = [str(tool_path("helm")), *args]
    if kubeconfig is not None:
        argv += ["--kubeconfig", str(kubeconfig)]
    # A private helm home: no repositories, caches or plugins of the machine leak into the test.
    home = Path("/tmp") / "hsx-helm-home"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def render_text(
    values: dict[str, str] | None = None,
    namespace: str = "hsx-system",
    release: str = "hsx",
    *,
    with_tests: bool = True,
) -> str:
    skip = [] if with_tests else ["--skip-tests"]
    return helm("template", release, str(CHART), "--namespace", namespace, *skip, *set_args(values or {})).stdout


def render(
    values: dict[str, str] | None = None,
    namespace: str = "hsx-system",
    release: str = "hsx",
    *,
    with_tests: bool = False,
) -> list[dict[str, Any]]:
    """The chart's manifests as installed (CRDs excluded: helm template leaves crds/ out unless
    --include-crds; `helm test`'s hook objects only with `with_tests`)."""
    text = render_text(values, namespace, release, with_tests=with_tests)
    return [d for d in yaml.safe_load_all(text) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def chart_meta() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())
