"""Every manifest in examples/ is accepted by the real API server with the real CRD (server-side dry run)."""

from __future__ import annotations

import copy
import string
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_operator.api import ExtractionJobSpec
from hsx_operator.desired import Owner
from hsx_operator.group import desired_run, pod_specs
from hsx_operator.policy import NodeAccessPolicy, violations
from tests.install.chart import CHART, ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


# examples/quickstart.yaml is filled in by envsubst with the README's variables; these stand for a user's.
QUICKSTART_VALUES = {
    "MODEL_DIR": "Llama-3.1-8B-Instruct", "DATASET": "datasets/chat.jsonl", "REGISTRY": "registry.example.com/hsx",
    "BUCKET": "my-hidden-states", "S3_ENDPOINT": "https://s3.us-east-1.amazonaws.com", "S3_REGION": "us-east-1",
    "S3_PATH_STYLE": "false",
}  # fmt: skip


def documents(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    if path.name == "quickstart.yaml":
        text = string.Template(text).safe_substitute(QUICKSTART_VALUES)
        left = [line for line in text.splitlines() if "$" in line and not line.lstrip().startswith("#")]
        assert not left, f"variables the README does not set: {left}"
    return [d for d in yaml.safe_load_all(text) if d]


def test_the_promised_examples_exist() -> None:
    kinds = {p.name: [d["kind"] for d in documents(p)] for p in EXAMPLES}
    assert kinds == {
        "data-parallel.yaml": ["ExtractionJob"],
        "kimi-k2.5-production.yaml": ["ExtractionJob"],
        "minimal.yaml": ["ExtractionJob"],
        "multi-node.yaml": ["ExtractionJob"],
        "quickstart.yaml": ["ExtractionJob"],
        "s3-credentials-secret.yaml": ["Secret"],
    }


def test_production_example_has_the_production_settings() -> None:
    (xj,) = documents(ROOT / "examples" / "kimi-k2.5-production.yaml")
    spec = ExtractionJobSpec.model_validate(xj["spec"])
    assert spec.tensor_parallel() == 8 and spec.server.gpus == 8
    assert spec.server.shmSize != ExtractionJobSpec.model_fields["server"].default_factory().shmSize  # type: ignore[misc]
    assert spec.scheduling.tolerations and spec.scheduling.queueName
    assert spec.output.uri.startswith("s3://") and spec.output.credentialsSecret == "hsx-s3-credentials"
    assert spec.output.compression == "bf16-zstd"


def test_data_parallel_example_is_data_parallel() -> None:
    (xj,) = documents(ROOT / "examples" / "data-parallel.yaml")
    spec = ExtractionJobSpec.model_validate(xj["spec"])
    assert spec.parallelism > 1 and spec.server.gpus // spec.tensor_parallel() > 1


def test_multi_node_example_is_one_group_kueue_places_in_one_domain() -> None:
    """Kueue groups exactly two pod sets (one of a single pod) into one topology domain: a group of two nodes."""
    (xj,) = documents(ROOT / "examples" / "multi-node.yaml")
    spec = ExtractionJobSpec.model_validate(xj["spec"])
    jobset = desired_run(Owner(name=xj["metadata"]["name"], namespace="ml", uid="u"), spec)
    assert jobset["kind"] == "JobSet" and spec.server.nodes == 2 and spec.parallelism == 1
    for rjob in jobset["spec"]["replicatedJobs"]:
        annotations = rjob["template"]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["kueue.x-k8s.io/podset-group-name"] == "leader"
        assert annotations["kueue.x-k8s.io/podset-required-topology"] == "cloud.provider.com/topology-rack"


def test_examples_use_the_secret_template_name() -> None:
    (secret,) = documents(ROOT / "examples" / "s3-credentials-secret.yaml")
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for path in EXAMPLES:
        for doc in documents(path):
            if doc["kind"] == "ExtractionJob":
                assert doc["spec"]["output"].get("credentialsSecret") == secret["metadata"]["name"], path.name


def test_examples_run_under_the_charts_default_policy() -> None:
    """No example needs a host path: the datasets sit on the model's PVC (read through its volume)."""
    for path in EXAMPLES:
        for doc in documents(path):
            if doc["kind"] == "ExtractionJob":
                spec = ExtractionJobSpec.model_validate(doc["spec"])
                owner = Owner(name=doc["metadata"]["name"], namespace="ml", uid="u")
                for pod in pod_specs(desired_run(owner, spec)):
                    assert violations(pod, NodeAccessPolicy()) == [], path.name


@pytest.fixture(scope="module")
def crds(kube_cluster: Any) -> None:
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    kube_cluster.wait_crd_established("extractionjobs.hsx.dev")


def dry_run(kube_cluster: Any, namespace: str, doc: dict[str, Any]) -> Any:
    body = copy.deepcopy(doc)
    body["metadata"]["namespace"] = namespace
    return kube_cluster.kubectl(
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "-o",
        "yaml",
        "-f",
        "-",
        input=yaml.safe_dump(body),
        check=False,
    )


@pytest.mark.cluster
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_passes_the_api_server(kube_cluster: Any, namespace: str, crds: None, path: Path) -> None:
    for doc in documents(path):
        result = dry_run(kube_cluster, namespace, doc)
        assert result.returncode == 0, result.stderr
        assert "Warning" not in result.stderr, result.stderr
        accepted = yaml.safe_load(result.stdout)
        assert accepted["kind"] == doc["kind"] and accepted["metadata"]["namespace"] == namespace
        if doc["kind"] == "ExtractionJob":
            # The CRD's defaults were applied: the API server really used its schema.
            assert accepted["spec"]["output"]["compression"] == "bf16-zstd", accepted["spec"]["output"]


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"server": {"gpus": 8, "tensorParallel": 3}}, "multiple of server.tensorParallel"),
        ({"runId": "Not_Valid"}, "spec.runId"),
        ({"outptu": {"uri": "s3://x/y"}}, "outptu"),
    ],
)
def test_the_api_server_rejects_a_broken_example(
    kube_cluster: Any, namespace: str, crds: None, change: dict[str, Any], message: str
) -> None:
    # Control: the dry runs above can fail.
    (doc,) = documents(ROOT / "examples" / "minimal.yaml")
    doc["spec"].update(change)
    result = dry_run(kube_cluster, namespace, doc)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
