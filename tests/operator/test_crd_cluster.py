"""The CRD on a real API server: invalid manifests are rejected with a useful message."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from hsx_operator.api import ExtractionJobSpec

pytestmark = pytest.mark.cluster

VALID: dict[str, Any] = {
    "apiVersion": "hsx.dev/v1alpha1",
    "kind": "ExtractionJob",
    "metadata": {"name": "xj"},
    "spec": {
        "runId": "r1",
        "model": {"path": "/models/tiny", "source": {"hostPath": {"path": "/srv/models"}}},
        "dataset": {"uri": "s3://data/chat.jsonl"},
        "output": {"uri": "s3://out/hs"},
    },
}


def _with(path: str, value: Any) -> dict[str, Any]:
    """VALID with spec.<path> set (value DELETE removes it)."""
    doc = copy.deepcopy(VALID)
    node = doc["spec"]
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return doc


def _vllm_post_norm() -> dict[str, Any]:
    doc = _with("server", {"engine": "vllm"})
    doc["spec"]["model"]["finalState"] = "post-norm"
    return doc


def _regenerate_tokens() -> dict[str, Any]:
    doc = _with("responses", "regenerate")
    doc["spec"]["dataset"]["format"] = "tokens"
    return doc


def _regenerate_vllm_sampling() -> dict[str, Any]:
    doc = _with("responses", "regenerate")
    doc["spec"]["server"] = {"engine": "vllm"}
    doc["spec"]["generation"] = {"temperature": 0.7}
    return doc


DELETE = object()

# (case id, manifest, fragment the API server's answer must contain)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("no-runId", _with("runId", DELETE), "spec.runId: Required value"),
    ("runId-uppercase", _with("runId", "Run1"), "spec.runId: Invalid value"),
    ("runId-reserved", _with("runId", "manifest"), "runId 'manifest' is reserved"),
    ("runId-too-long", _with("runId", "r" * 41), "spec.runId: Too long"),
    ("no-model", _with("model", DELETE), "spec.model: Required value"),
    ("model-path-relative", _with("model.path", "models/tiny"), "spec.model.path: Invalid value"),
    (
        "model-two-sources",
        _with("model.source", {"hostPath": {"path": "/a"}, "pvc": {"claimName": "w"}}),
        "exactly one of pvc, hostPath or image",
    ),
    ("model-empty-source", _with("model.source", {}), "exactly one of pvc, hostPath or image"),
    (
        "model-path-outside-mount",
        _with("model.path", "/weights/tiny"),
        "model.path must lie inside model.mountPath",
    ),
    (
        "no-tokenizer-anywhere",
        _with("model.source", DELETE),
        "set model.source (mounted in both containers) or dataset.tokenizer",
    ),
    ("aux-layers-too-many", _with("model.auxLayerIds", list(range(9))), "spec.model.auxLayerIds: Too many"),
    ("aux-layer-negative", _with("model.auxLayerIds", [-1, 2, 3]), "should be greater than or equal to 0"),
    ("gpus-zero", _with("server.gpus", 0), "spec.server.gpus: Invalid value"),
    ("gpus-too-many", _with("server.gpus", 17), "should be less than or equal to 16"),
    (
        "tp-not-dividing-gpus",
        _with("server.tensorParallel", 3),
        "server.gpus must be a multiple of server.tensorParallel",
    ),
    (
        "gpu-in-resources",
        _with("server.resources", {"limits": {"nvidia.com/gpu": "8"}}),
        "set server.gpus instead",
    ),
    (
        "dump-dir-env-override",
        _with("server.env", [{"name": "SGLANG_HS_DUMP_DIR", "value": "/x"}]),
        "SGLANG_HS_DUMP_DIR is set by the operator",
    ),
    (
        "extra-args-override-owned-flag",
        _with("server.extraArgs", ["--mem-fraction-static", "0.8", "--tp-size=4"]),
        "server.extraArgs may not set flags extraction mode owns",
    ),
    (
        "env-bad-name",
        _with("server.env", [{"name": "1BAD", "value": "x"}]),
        "spec.server.env[0].name: Invalid value",
    ),
    (
        "extractor-env-hsx-own",
        _with("extractor.env", [{"name": "HTTPS_PROXY", "value": "x"}, {"name": "AWS_CA_BUNDLE", "value": "/x"}]),
        "extractor.env may not set hsx's own variables",
    ),
    ("shm-not-a-quantity", _with("server.shmSize", "lots"), "spec.server.shmSize: Invalid value"),
    ("shm-absurd", _with("server.shmSize", "9999999Ei"), "server.shmSize must be at most 4Ti"),
    (
        "dump-dir-absurd",
        _with("extractor.dumpDirMaxBytes", 1 << 50),
        "spec.extractor.dumpDirMaxBytes: Invalid value",
    ),
    ("output-s3-no-bucket", _with("output.uri", "s3://"), "output.uri must be s3://bucket/key: a bucket"),
    ("dataset-s3-empty-bucket", _with("dataset.uri", "s3:///chat.jsonl"), "dataset.uri must be s3://bucket"),
    ("output-s3-newline", _with("output.uri", "s3://out/hs\nx"), "output.uri must be s3://bucket/key: a"),
    ("region-newline", _with("output.region", "us-east-1\n"), "spec.output.region: Invalid value"),
    ("dataset-region-space", _with("dataset.region", "us east"), "spec.dataset.region: Invalid value"),
    (
        "startup-timeout-too-short",
        _with("server.startupTimeoutSeconds", 5),
        "should be greater than or equal to 10",
    ),
    ("pull-policy-unknown", _with("server.imagePullPolicy", "Sometimes"), 'Unsupported value: "Sometimes"'),
    ("dataset-format-unknown", _with("dataset.format", "csv"), 'Unsupported value: "csv"'),
    ("dataset-uri-empty", _with("dataset.uri", ""), "spec.dataset.uri: Invalid value"),
    ("max-length-zero", _with("dataset.maxLength", 0), "spec.dataset.maxLength: Invalid value"),
    (
        "fingerprint-not-hex",
        _with("dataset.expectedTokenizerFingerprint", "XYZ"),
        "spec.dataset.expectedTokenizerFingerprint: Invalid value",
    ),
    ("compression-unknown", _with("output.compression", "gzip"), 'Unsupported value: "gzip"'),
    (
        "shard-too-small",
        _with("output.shardTargetBytes", 1000),
        "spec.output.shardTargetBytes: Invalid value",
    ),
    ("on-mismatch-unknown", _with("validation.onMismatch", "ignore"), 'Unsupported value: "ignore"'),
    (
        "mismatch-rate-above-one",
        _with("validation.maxMismatchRate", 1.5),
        "spec.validation.maxMismatchRate: Invalid value",
    ),
    ("concurrency-zero", _with("concurrency", 0), "spec.concurrency: Invalid value"),
    ("parallelism-too-high", _with("parallelism", 65), "spec.parallelism: Invalid value"),
    ("backoff-negative", _with("backoffLimit", -1), "spec.backoffLimit: Invalid value"),
    (
        "startup-deadline-after-active",
        {
            **_with("startupDeadlineSeconds", 600),
            "spec": {**_with("startupDeadlineSeconds", 600)["spec"], "activeDeadlineSeconds": 300},
        },
        "startupDeadlineSeconds must be shorter than activeDeadlineSeconds",
    ),
    ("suspend-not-bool", _with("suspend", "yes"), "spec.suspend: Invalid value"),
    (
        "queue-name-not-a-label",
        _with("scheduling.queueName", "team a!"),
        "spec.scheduling.queueName: Invalid value",
    ),
    (
        "toleration-operator-unknown",
        _with("scheduling.tolerations", [{"key": "k", "operator": "Maybe"}]),
        'Unsupported value: "Maybe"',
    ),
    ("unknown-field-typo", _with("outptu", {"uri": "x"}), 'unknown field "spec.outptu"'),
    # URIs and endpoints that would mean something else inside the pod (issue 18, item 3).
    ("output-s3-single-slash", _with("output.uri", "s3:/bucket/out"), "output.uri must be s3://bucket/key"),
    ("dataset-relative-path", _with("dataset.uri", "data/chat.jsonl"), "dataset.uri must be s3://bucket/key"),
    ("dataset-http-uri", _with("dataset.uri", "https://example.com/chat.jsonl"), "dataset.uri must be"),
    ("output-endpoint-no-scheme", _with("output.endpoint", "minio:9000"), "output.endpoint must be an http://"),
    ("dataset-endpoint-no-scheme", _with("dataset.endpoint", "s3.local"), "dataset.endpoint must be an http://"),
    # Cross-field rules (issue 18, item 4).
    (
        "model-path-sibling-of-mount",
        _with("model.path", "/models-other/tiny"),
        "/models-other is not inside /models",
    ),
    ("aux-layers-repeated", _with("model.auxLayerIds", [2, 30, 2]), "model.auxLayerIds must be distinct"),
    (
        "extra-args-abbreviated-owned-flag",
        _with("server.extraArgs", ["--tp-siz", "4"]),
        "nor any abbreviation of them (SGLang reads --tp-siz as --tp-size)",
    ),
    (
        "extra-args-abbreviated-model-path",
        _with("server.extraArgs", ["--mod=/elsewhere"]),
        "server.extraArgs may not set flags extraction mode owns",
    ),
    (
        "extra-args-alias-of-owned-flag",
        _with("server.extraArgs", ["--pipeline-parallel-size", "2"]),
        "server.extraArgs may not set flags extraction mode owns",
    ),
    ("extra-args-config-file", _with("server.extraArgs", ["--config", "/etc/sglang.yaml"]), "nor --config"),
    (
        "memory-limit-not-above-shm",
        _with("server.resources", {"limits": {"memory": "16Gi"}}),
        "server.resources.limits.memory must be larger than server.shmSize",
    ),
    (
        "dump-dir-max-not-below-shm",
        _with("extractor", {"dumpDirMaxBytes": 32 << 30}),
        "extractor.dumpDirMaxBytes must be smaller than server.shmSize",
    ),
    (
        "server-port-is-progress-port",
        _with("server.port", 8080),
        "server.port and extractor.progressPort must differ",
    ),
    # server.engine vllm: vLLM's own flags are guarded (its launcher's check), and one TP group per pod.
    ("engine-unknown", _with("server.engine", "trtllm"), 'Unsupported value: "trtllm"'),
    (
        "vllm-extra-args-speculative-config",
        _with("server", {"engine": "vllm", "extraArgs": ["--speculative-config", "{}"]}),
        "vLLM: ",
    ),
    (
        "vllm-extra-args-short-tp",
        _with("server", {"engine": "vllm", "extraArgs": ["-tp", "2"]}),
        "server.extraArgs may not set flags extraction mode owns",
    ),
    (
        "vllm-extra-args-abbreviated-prefix-caching",
        _with("server", {"engine": "vllm", "extraArgs": ["--enable-prefix-cach"]}),
        "server.extraArgs may not set flags extraction mode owns",
    ),
    (
        "vllm-data-parallel",
        _with("server", {"engine": "vllm", "gpus": 8, "tensorParallel": 4}),
        "server.engine vllm runs one tensor-parallel group per pod",
    ),
    ("vllm-post-norm", _vllm_post_norm(), "model.finalState post-norm needs server.engine sglang"),
    ("vllm-nodes", _with("server", {"engine": "vllm", "nodes": 2}), "server.nodes > 1 needs server.engine sglang"),
    (
        "nodes-data-parallel",
        _with("server", {"nodes": 2, "gpus": 8, "tensorParallel": 4}),
        "with server.nodes > 1 the server is one tensor-parallel group",
    ),
    ("topology-without-queue", _with("scheduling", {"topology": {"level": "example.com/rack"}}), "set scheduling.queueName too"),
    ("nodes-nine", _with("server", {"nodes": 9}), "spec.server.nodes: Invalid value"),
    ("no-spec", {k: v for k, v in VALID.items() if k != "spec"}, "spec: Required value"),
    ("continue-from-itself", _with("continueFrom", "r1"), "continueFrom names an earlier runId"),
    ("pod-label-long-value", _with("pod", {"labels": {"team": "x" * 64}}), "spec.pod.labels.team: Too long"),
    ("pod-sa-uppercase", _with("pod", {"serviceAccountName": "Builder"}), "spec.pod.serviceAccountName: Invalid value"),
    ("pod-pull-secret-bad", _with("pod", {"imagePullSecrets": ["a b"]}), "spec.pod.imagePullSecrets[0]: Invalid value"),
    (
        "pod-volume-two-sources",
        _with("pod", {"volumes": [{"name": "tok", "mountPath": "/tok", "configMap": "a", "secret": "b"}]}),
        "exactly one of configMap, secret or persistentVolumeClaim",
    ),
    (
        "pod-volume-same-name",
        _with("pod", {"volumes": [{"name": "a", "mountPath": "/a", "secret": "s"}, {"name": "a", "mountPath": "/b", "secret": "t"}]}),
        "Duplicate value",
    ),
    ("pod-volume-relative", _with("pod", {"volumes": [{"name": "a", "mountPath": "a", "secret": "s"}]}), "mountPath: Invalid value"),
    (
        "regenerate-tokens",
        _regenerate_tokens(),
        "responses: regenerate needs conversations",
    ),
    ("generation-bad-top-p", _with("generation", {"topP": 0}), "spec.generation.topP: Invalid value"),
    ("regenerate-vllm-sampling", _regenerate_vllm_sampling(), "needs generation.temperature 0"),
    ("responses-unknown", _with("responses", "rewrite"), "spec.responses: Unsupported value"),
    (
        "name-with-dots",
        {**VALID, "metadata": {"name": "llama-3.1-8b"}},
        "metadata.name may not contain dots",
    ),
]


@pytest.mark.parametrize("case, manifest, fragment", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifest_is_rejected(
    xj_crd: Any, namespace: str, case: str, manifest: dict[str, Any], fragment: str
) -> None:
    result = xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
    assert result.returncode != 0, f"{case} was accepted"
    assert fragment in result.stderr, result.stderr
    assert xj_crd.kubectl("get", "xj", "-n", namespace, "-o", "name").stdout.strip() == ""


def test_cross_field_rules_let_sound_specs_through(xj_crd: Any, namespace: str) -> None:
    doc = _with("model.path", "/models")  # the mount itself is inside it
    doc["spec"]["model"]["auxLayerIds"] = [2, 30, 58]
    doc["spec"]["server"] = {
        "shmSize": "24Gi",
        "resources": {"limits": {"memory": "64Gi"}},
        "extraArgs": ["--mem-fraction-static=0.8", "--trust-remote-code", "--context-length", "4096"],
    }
    doc["spec"]["extractor"] = {"dumpDirMaxBytes": 16 << 30, "env": [{"name": "HTTPS_PROXY", "value": "http://p:3128"}]}
    doc["spec"]["pod"] = {"serviceAccountName": "s3-reader", "imagePullSecrets": ["registry"], "labels": {"team": "ml"},
                          "annotations": {"example.com/cost": "a"}, "runtimeClassName": "nvidia",
                          "caBundleConfigMap": "corp-ca", "volumes": [{"name": "tok", "mountPath": "/tok", "configMap": "t"},
                          {"name": "data", "mountPath": "/data", "persistentVolumeClaim": "d", "readOnly": False}]}  # fmt: skip
    xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))
    # vLLM with its own tuning flags (SGLang's owned --context-length is vLLM's to take).
    doc["metadata"]["name"] = "xj-vllm"
    doc["spec"]["server"] = {"engine": "vllm", "gpus": 2, "shmSize": "24Gi", "extraArgs": ["--gpu-memory-utilization=0.8",
                             "--max-num-seqs", "64", "--context-length", "4096"]}  # fmt: skip
    xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))
    # Regenerating a chat dataset, every sampling setting given.
    doc["metadata"]["name"] = "xj-regen"
    doc["spec"]["server"] = {"engine": "sglang", "shmSize": "24Gi"}  # sampling: vLLM regenerates greedily only
    doc["spec"]["responses"] = "regenerate"
    doc["spec"]["generation"] = {"turns": "each", "maxNewTokens": 512, "temperature": 0.7, "topP": 0.9, "seed": 1,
                                 "stop": ["</answer>"], "onTruncated": "keep"}  # fmt: skip
    xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))
    # A server over two nodes.
    doc["metadata"]["name"] = "xj-group"
    doc["spec"]["server"] = {"nodes": 2, "gpus": 8, "shmSize": "24Gi"}
    xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))


def test_a_groups_parallelism_is_fixed_for_its_run(xj_crd: Any, namespace: str) -> None:
    """A one-pod run's parallelism moves mid-run (the fleet leases shards); a run of groups is one JobSet."""
    doc = _with("server", {"nodes": 2})
    xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))
    patch = ["patch", "xj", "xj", "-n", namespace, "--type=merge", "-p"]
    refused = xj_crd.kubectl(*patch, '{"spec":{"parallelism":2}}', check=False)
    assert refused.returncode != 0 and "the run's groups are one JobSet, fixed for the run" in refused.stderr
    xj_crd.kubectl(*patch, '{"spec":{"parallelism":2,"runId":"r2"}}')


def test_there_are_at_least_twenty_kinds() -> None:
    assert len({c[0] for c in INVALID}) >= 20


def test_valid_manifest_gets_the_models_defaults(xj_crd: Any, namespace: str) -> None:
    xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(VALID))
    stored = json.loads(xj_crd.kubectl("get", "xj", "xj", "-n", namespace, "-o", "json").stdout)["spec"]
    expected = ExtractionJobSpec.model_validate(VALID["spec"]).model_dump(mode="json", exclude_none=True)
    assert ExtractionJobSpec.model_validate(stored).model_dump(mode="json", exclude_none=True) == expected
    # Every default the models fill in (other than empty lists and maps) was filled in by the API server too.
    assert _numbers_as_floats(stored) == _numbers_as_floats(_without_empty(expected))


def _without_empty(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: _without_empty(v)
            for k, v in node.items()
            if v not in ({}, []) or k in ("resources", "scheduling")
        }
    return node


def _numbers_as_floats(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _numbers_as_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_numbers_as_floats(v) for v in node]
    if isinstance(node, int | float) and not isinstance(node, bool):
        return float(node)
    return node


def test_spec_is_locked_while_runid_stays(xj_crd: Any, namespace: str) -> None:
    xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(VALID))
    changed = xj_crd.kubectl(
        "patch", "xj", "xj", "-n", namespace, "--type=merge", "-p", '{"spec":{"concurrency":5}}', check=False
    )
    assert changed.returncode != 0
    assert "only runId, suspend and parallelism may change; to run with other settings, change runId too" in changed.stderr
    window = xj_crd.kubectl(
        "patch",
        "xj",
        "xj",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"activeDeadlineSeconds":60}}',
        check=False,
    )
    assert window.returncode != 0 and "change runId too" in window.stderr
    for patch in ('{"spec":{"continueFrom":"r0"}}', '{"spec":{"pod":{"labels":{"team":"ml"}}}}'):
        refused = xj_crd.kubectl("patch", "xj", "xj", "-n", namespace, "--type=merge", "-p", patch, check=False)
        assert refused.returncode != 0 and "change runId too" in refused.stderr, patch
    xj_crd.kubectl("patch", "xj", "xj", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    xj_crd.kubectl(
        "patch", "xj", "xj", "-n", namespace, "--type=merge", "-p", '{"spec":{"runId":"r2","concurrency":5}}'
    )
    spec = json.loads(xj_crd.kubectl("get", "xj", "xj", "-n", namespace, "-o", "json").stdout)["spec"]
    assert (spec["runId"], spec["concurrency"], spec["suspend"]) == ("r2", 5, True)


def test_explain_reads_well(xj_crd: Any) -> None:
    out = xj_crd.kubectl("explain", "extractionjob.spec.output").stdout
    assert "Where shards go and how they are stored." in out
    assert "credentialsSecret" in out and "it never reads it" in out
    assert "enum: none, bf16-zstd" in out
    short = xj_crd.kubectl("explain", "xj.spec.server.gpus").stdout
    assert "nvidia.com/gpu limit" in short


def test_printer_columns_on_the_server(xj_crd: Any, namespace: str) -> None:
    xj_crd.kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(VALID))
    narrow = xj_crd.kubectl("get", "xj", "-n", namespace).stdout.splitlines()[0].split()
    assert narrow == ["NAME", "PHASE", "REASON", "PROGRESS", "WRITTEN", "QUARANTINED", "TOK/S", "ETA", "AGE"]
    wide = xj_crd.kubectl("get", "xj", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-5:] == ["RUN", "ATTEMPT", "PODS", "NODES", "SHARDS"] and "r1" in wide[1]
