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
