"""The cluster admin's defaults (issue 33 item 2): filled where a spec is silent, never over what it says,
rendered into the Job and checked by the same policy as the spec's own fields. Plain dicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hsx_operator.api import DEFAULT_EXTRACTOR_IMAGE, DEFAULT_SERVER_IMAGES
from hsx_operator.cluster_defaults import ClusterDefaults, S3Store, read_defaults, with_cluster_defaults
from hsx_operator.desired import Owner, desired_config_map, desired_job, initial_suspend, with_queue_label
from hsx_operator.policy import NodeAccessPolicy, violations
from tests.operator.helpers import make_spec

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner(name="xj", namespace="ns", uid="uid-1")
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ADMIN = ClusterDefaults.model_validate(
    {
        "imageRegistry": "registry.example.com/mirror/hsx",
        "imagePullSecrets": ["mirror-pull"],
        "nodeSelector": {"pool": "gpu", "zone": "a"},
        "tolerations": [GPU_TAINT],
        "priorityClassName": "batch-low",
        "queueName": "team-queue",
        "s3": {"endpoint": "https://s3.internal.example.com", "region": "dc1", "pathStyle": True},
        "caBundleConfigMap": "internal-ca",
    }
)


def pod(spec: object) -> dict:
    return desired_job(OWNER, spec)["spec"]["template"]["spec"]  # type: ignore[arg-type]


def images(pod_spec: dict) -> dict[str, str]:
    return {c["name"]: c["image"] for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]}


def test_a_silent_spec_takes_every_default_and_the_job_says_which() -> None:
    spec, filled = with_cluster_defaults(make_spec(output={"uri": "s3://bucket/runs"}), ADMIN)
    assert filled == [
        "server.image", "extractor.image", "scheduling.nodeSelector", "scheduling.tolerations",
        "scheduling.priorityClassName", "scheduling.queueName", "pod.imagePullSecrets", "pod.caBundleConfigMap",
        "output.endpoint",
    ]  # fmt: skip
    rendered = pod(spec)
    mirrored = {DEFAULT_SERVER_IMAGES["sglang"], DEFAULT_EXTRACTOR_IMAGE}
    assert set(images(rendered).values()) == {f"registry.example.com/mirror/hsx/{i.rsplit('/', 1)[1]}" for i in mirrored}
    assert rendered["imagePullSecrets"] == [{"name": "mirror-pull"}]
    assert rendered["nodeSelector"] == {"pool": "gpu", "zone": "a"} and GPU_TAINT in rendered["tolerations"]
    assert rendered["priorityClassName"] == "batch-low"
    assert initial_suspend(spec)  # a queue: the Job starts suspended for Kueue
    assert any(v.get("configMap", {}).get("name") == "internal-ca" for v in rendered["volumes"])
    config = yaml.safe_load(desired_config_map(OWNER, spec)["data"]["config.yaml"])
    assert config["output"]["endpoint"] == "https://s3.internal.example.com" and config["output"]["pathStyle"] is True


def test_what_a_spec_says_wins() -> None:
    spec, filled = with_cluster_defaults(
        make_spec(
            server={"image": "team/sglang:1"},
            extractor={"image": "team/extractor:1"},
            scheduling={"nodeSelector": {"zone": "b"}, "tolerations": [GPU_TAINT, {"key": "team", "operator": "Exists"}],
                        "priorityClassName": "batch-high", "queueName": "own-queue"},
            pod={"imagePullSecrets": ["team-pull", "mirror-pull"], "caBundleConfigMap": "team-ca"},
            output={"uri": "s3://bucket/runs", "endpoint": "https://minio.team.example.com"},
        ),
        ADMIN,
    )  # fmt: skip
    rendered = pod(spec)
    assert set(images(rendered).values()) == {"team/sglang:1", "team/extractor:1"}
    assert rendered["nodeSelector"] == {"pool": "gpu", "zone": "b"}  # merged, the spec's key wins
    assert rendered["tolerations"].count(GPU_TAINT) == 1 and {"key": "team", "operator": "Exists"} in rendered["tolerations"]
    assert rendered["imagePullSecrets"] == [{"name": "mirror-pull"}, {"name": "team-pull"}]  # the admin's first, once
    assert rendered["priorityClassName"] == "batch-high" and spec.scheduling.queueName == "own-queue"
    assert spec.pod.caBundleConfigMap == "team-ca" and spec.output.endpoint == "https://minio.team.example.com"
    assert "server.image" not in filled and "output.endpoint" not in filled and "scheduling.queueName" not in filled


def test_the_queue_label_wins_over_the_default_queue_and_local_outputs_take_no_store() -> None:
    labelled = with_queue_label(make_spec(), {"kueue.x-k8s.io/queue-name": "from-label"})
    spec, filled = with_cluster_defaults(labelled, ADMIN)
    assert spec.scheduling.queueName == "from-label" and "scheduling.queueName" not in filled
    local, filled = with_cluster_defaults(make_spec(output={"uri": "/scratch/out"}), ClusterDefaults(s3=S3Store(endpoint="https://s3.x")))
    assert local.output.endpoint is None and filled == []


def test_explicit_default_images_win_over_the_mirror_per_engine() -> None:
    admin = ClusterDefaults(imageRegistry="mirror.example.com/hsx", serverImages={"vllm": "mirror.example.com/vllm:custom"})
    vllm, _ = with_cluster_defaults(make_spec(server={"engine": "vllm"}), admin)
    assert vllm.server_image() == "mirror.example.com/vllm:custom"
    assert vllm.extractor_image() == f"mirror.example.com/hsx/{DEFAULT_EXTRACTOR_IMAGE.rsplit('/', 1)[1]}"
    untouched, filled = with_cluster_defaults(make_spec(), ClusterDefaults())
    assert filled == [] and untouched.extractor_image() == DEFAULT_EXTRACTOR_IMAGE


def test_the_policy_checks_the_defaults_as_rendered() -> None:
    spec, _ = with_cluster_defaults(make_spec(), ClusterDefaults(extractorImage="docker.io/someone/extractor:1"))
    policy = NodeAccessPolicy.of(["/srv/models"], image_prefixes=["ghcr.io/hsx-dev/"])
    (why,) = violations(pod(spec), policy)
    assert "docker.io/someone/extractor:1" in why and "policy.allowedImagePrefixes" in why


def test_a_region_alone_keeps_aws_and_defaults_are_checked_like_the_spec(tmp_path: Path) -> None:
    aws, filled = with_cluster_defaults(make_spec(output={"uri": "s3://bucket/runs", "region": "us-west-2"}), ADMIN)
    assert aws.output.endpoint is None and aws.output.region == "us-west-2" and "output.endpoint" not in filled
    for bad, field in (('{"s3": {"endpoint": "minio:9000"}}', "s3.endpoint"), ('{"imagePullSecrets": ["A B"]}', "imagePullSecrets"),
                       ('{"caBundleConfigMap": "Bad_Name"}', "caBundleConfigMap")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"clusterDefaults\.{field}"):
            ClusterDefaults.from_json(bad)
    values = tmp_path / "values.yaml"  # the chart's whole values file: its clusterDefaults block is read
    values.write_text("replicaCount: 1\nclusterDefaults:\n  queueName: team\n")
    assert read_defaults(f"@{values}") == ClusterDefaults(queueName="team")


def test_bad_defaults_stop_the_operator_with_the_field_named() -> None:
    with pytest.raises(ValueError, match=r"--cluster-defaults: clusterDefaults\.imagePullSecret"):
        ClusterDefaults.from_json('{"imagePullSecret": ["x"]}')
    with pytest.raises(ValueError, match=r"--cluster-defaults: clusterDefaults\.s3\.endpoint"):
        ClusterDefaults.from_json('{"s3": {"region": "dc1"}}')
    with pytest.raises(ValueError, match="not JSON"):
        ClusterDefaults.from_json("{imageRegistry: x}")
    assert ClusterDefaults.from_json("") == ClusterDefaults()


def test_the_charts_schema_names_every_default_and_only_those() -> None:
    schema = json.loads((ROOT / "charts" / "hsx" / "values.schema.json").read_text())["properties"]["clusterDefaults"]
    assert sorted(schema["properties"]) == sorted(ClusterDefaults.model_fields)
    assert sorted(schema["properties"]["s3"]["properties"]) == sorted(S3Store.model_fields)
    assert sorted(schema["properties"]["serverImages"]["properties"]) == sorted(DEFAULT_SERVER_IMAGES)
