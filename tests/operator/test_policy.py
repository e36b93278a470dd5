"""The admin's node-access policy against the pod ``desired`` renders (issue 14 item 8): plain dicts."""

from __future__ import annotations

import pytest

from hsx_operator.desired import Owner, desired_job
from hsx_operator.policy import NodeAccessPolicy, under, violations
from tests.operator.helpers import make_spec

OWNER = Owner(name="xj", namespace="ns", uid="uid-1")
S3_MODEL = {"path": "/models/m", "source": {"pvc": {"claimName": "models"}}}


def pod_of(**overrides: object) -> dict:
    return desired_job(OWNER, make_spec(**overrides))["spec"]["template"]["spec"]


def test_under_compares_whole_path_components() -> None:
    assert under("/data/sets", "/data") and under("/data", "/data/") and under("/x", "/")
    assert not under("/data2", "/data") and not under("/", "/data")
    assert not under("/data/../etc", "/data")  # normalised before comparing


def test_no_host_path_is_allowed_by_default() -> None:
    pod = pod_of(model={"path": "/models/tiny", "source": {"hostPath": {"path": "/"}}})
    (why,) = violations(pod, NodeAccessPolicy())
    assert "spec.model.source.hostPath.path mounts host path /" in why and "allowed prefixes: none" in why
    assert "policy.allowedHostPaths" in why


def test_each_local_uri_is_checked_and_named() -> None:
    pod = pod_of(model=S3_MODEL, dataset={"uri": "/data/sets/chat.jsonl"}, output={"uri": "file:///scratch/out"})
    policy = NodeAccessPolicy.of(["/data"])
    (why,) = violations(pod, policy)
    assert why.startswith("spec.output.uri mounts host path /scratch/out") and "allowed prefixes: /data" in why
    assert violations(pod, NodeAccessPolicy.of(["/data", "/scratch/"])) == []


def test_a_pvc_model_and_s3_data_need_no_allowance() -> None:
    assert violations(pod_of(model=S3_MODEL), NodeAccessPolicy()) == []


def test_a_dataset_under_the_model_mount_is_read_from_the_model_volume() -> None:
    # examples/minimal.yaml: the dataset sits on the model's PVC; no hostPath may shadow it.
    pod = pod_of(model=S3_MODEL, dataset={"uri": "/models/datasets/chat.jsonl"})
    assert [v["name"] for v in pod["volumes"] if "hostPath" in v] == []
    assert violations(pod, NodeAccessPolicy()) == []
    with pytest.raises(ValueError, match="mounted read-only"):
        pod_of(model=S3_MODEL, output={"uri": "/models/out"})


def test_system_priority_classes_need_the_admins_allowance() -> None:
    pod = pod_of(model=S3_MODEL, scheduling={"priorityClassName": "system-node-critical"})
    (why,) = violations(pod, NodeAccessPolicy())
    assert "system-node-critical is reserved" in why
    assert violations(pod, NodeAccessPolicy.of(priority_classes=["system-node-critical"])) == []
    assert violations(pod_of(model=S3_MODEL, scheduling={"priorityClassName": "batch-high"}), NodeAccessPolicy()) == []


def test_a_relative_prefix_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="must be absolute"):
        NodeAccessPolicy.of(["models"])


def test_images_outside_the_admins_registries_are_refused() -> None:
    spec = make_spec(model={"path": "/models/m", "source": {"image": {"reference": "docker.io/someone/weights:1"}}},
                     extractor={"image": "registry.example.com/ml/hsx-extractor:0.1.0"})  # fmt: skip
    pod = desired_job(Owner(name="xj", namespace="ml", uid="u"), spec)["spec"]["template"]["spec"]
    assert not [v for v in violations(pod, NodeAccessPolicy()) if "image" in v]  # no list: any image
    policy = NodeAccessPolicy.of(image_prefixes=["registry.example.com/ml/", "ghcr.io/hsx-dev"])
    found = [v for v in violations(pod, policy) if "image" in v]
    assert len(found) == 1 and "model volume image docker.io/someone/weights:1" in found[0], found
    assert "policy.allowedImagePrefixes" in found[0]
    # A prefix ends at a path component: ghcr.io/hsx-dev does not allow ghcr.io/hsx-devil/.
    devil = make_spec(server={"image": "ghcr.io/hsx-devil/sglang:1"})
    pod = desired_job(Owner(name="xj", namespace="ml", uid="u"), devil)["spec"]["template"]["spec"]
    assert any("sglang image ghcr.io/hsx-devil/sglang:1" in v for v in violations(pod, policy))
    with pytest.raises(ValueError, match="--allow-image-prefix"):
        NodeAccessPolicy.of(image_prefixes=["nginx"])
