"""The cluster admin's defaults on the real control plane and node agent (issue 33 item 2): an operator started
as the chart starts it (``--cluster-defaults``) fills a silent ExtractionJob's pod settings, the API server takes
the Job, the Job says which fields came from the defaults, and the run succeeds."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from hsx_operator.api import DEFAULT_EXTRACTOR_IMAGE
from hsx_operator.cluster_defaults import ANNOTATION
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import phase
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def test_a_silent_job_runs_with_the_clusters_defaults(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[..., OperatorProcess]
) -> None:
    defaults = {
        "extractorImage": DEFAULT_EXTRACTOR_IMAGE,  # the image the node agent runs, named by the admin
        "imagePullSecrets": ["mirror-pull"],
        "tolerations": [GPU_TAINT],
    }
    op = start_operator(f"--cluster-defaults={json.dumps(defaults)}")
    ns.apply(xj_manifest("silent", "r1", **run_env, scheduling={"tolerations": [{"key": "team", "operator": "Exists"}]}))
    job = wait_for(lambda: ns.get("job", "silent-r1"), 60, "the Job")
    assert job["metadata"]["annotations"][ANNOTATION] == "extractor.image,scheduling.tolerations,pod.imagePullSecrets"
    pod = job["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "mirror-pull"}]
    assert pod["tolerations"][0] == GPU_TAINT and {"key": "team", "operator": "Exists"} in pod["tolerations"]
    done = wait_for(phase(ns, "silent", "Succeeded", "Failed"), 300, "the run to end")
    assert done["phase"] == "Succeeded", (done, op.tail())
