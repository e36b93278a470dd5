"""Fixtures of the operator tests: the CRD installed on the session's control plane."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def xj_crd(kube_cluster: Any) -> Any:
    """The ExtractionJob CRD from crds/, applied and established."""
    kube_cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    kube_cluster.kubectl("wait", "--for=condition=Established", "crd/extractionjobs.hsx.dev", "--timeout=60s")
    return kube_cluster
