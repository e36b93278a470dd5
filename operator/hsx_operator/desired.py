"""Desired state: spec -> the run's ConfigMap and batch/v1 Job. Pure functions, no I/O.

The pod runs the extraction server as a native sidecar (an init container with
``restartPolicy: Always``) that owns the GPUs, and the extractor as the main container; they share
a memory-backed ``/dev/shm`` where the server leaves dumps for the extractor.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from hsx_extractor import protocol
from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import DATASET_CREDENTIALS_ENV, EXIT_PERMANENT
from hsx_extractor.sglang_hook import launch as sglang_launch
from hsx_extractor.storage.layout import MANIFEST_NAME
from hsx_extractor.vllm_hook import launch as vllm_launch
from hsx_operator.api import GROUP, KIND, VERSION, ExtractionJobSpec
from hsx_operator.pod_settings import apply_pod_settings
from hsx_operator.policy import under
from hsx_operator.sizing import (
    EXTRACTOR_DEFAULT_REQUESTS,
    extractor_workers,
    scratch_size_limit,
    server_default_requests,
)

# The server container of each engine, named after it (kubectl logs -c vllm).
SERVER_CONTAINERS = {"sglang": "sglang", "vllm": "vllm"}
EXTRACTOR_CONTAINER = "extractor"
# The extractor image's checks that need no server, run before the server loads weights.
PREFLIGHT_CONTAINER = "preflight"
CONFIG_DIR = "/etc/hsx"
CONFIG_FILE = "config.yaml"
SHM_DIR = "/dev/shm"
DUMP_DIR = f"{SHM_DIR}/hsx"
# Writable scratch (TMPDIR) for the extractor, whose root filesystem is read-only.
SCRATCH_DIR = "/scratch"
GPU_RESOURCE = "nvidia.com/gpu"
# The extractor image's user; the server image (CUDA, SGLang) decides its own.
EXTRACTOR_UID = 65532
MAX_LABEL_VALUE = 63
# Job names become pod label values and, with "-<index>" (parallelism <= 64), pod hostnames.
MAX_NAME = MAX_LABEL_VALUE - 3

LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_XJ = f"{GROUP}/extractionjob"
LABEL_RUN = f"{GROUP}/run-id"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
MANAGER = "hsx-operator"


@dataclass(frozen=True)
class Owner:
    """The ExtractionJob that owns what the operator creates."""

    name: str
    namespace: str
    uid: str

    def ref(self, run_id: str = "") -> str:
        """How log lines name the object: namespace/name, and the run when there is one."""
        return f"{self.namespace}/{self.name}" + (f" runId={run_id}" if run_id else "")

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def _shortened(text: str, limit: int) -> str:
    """``text``, or when longer than ``limit`` its head and a hash of all of it (still unique)."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{text[: limit - 9].rstrip('-_.')}-{digest}"


def job_name(xj_name: str, run_id: str) -> str:
    """``{name}-{runId}``, shortened with a hash when its pods' hostnames would not fit a DNS label."""
    return _shortened(f"{xj_name}-{run_id}", MAX_NAME)


def label_value(name: str) -> str:
    """An object name as a label value (names may be 253 characters, label values 63)."""
    return _shortened(name, MAX_LABEL_VALUE)


def config_map_name(xj_name: str, run_id: str) -> str:
    return f"{job_name(xj_name, run_id)}-config"


def output_prefix(spec: ExtractionJobSpec) -> str:
    """Where this run writes: ``{output.uri}/{runId}/`` (continueFrom's runId when continuing)."""
    return f"{spec.output.uri.rstrip('/')}/{spec.output_run_id()}/"


def manifest_uri(spec: ExtractionJobSpec) -> str:
    return output_prefix(spec) + MANIFEST_NAME


def labels(owner: Owner, spec: ExtractionJobSpec) -> dict[str, str]:
    out = {
        LABEL_NAME: "hsx",
        LABEL_COMPONENT: "extraction",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_XJ: label_value(owner.name),
        LABEL_RUN: spec.runId,
    }
    if spec.scheduling.queueName:
        out[LABEL_QUEUE] = spec.scheduling.queueName
    return out


def extract_config(spec: ExtractionJobSpec) -> ExtractConfig:
    """The extractor's config for every pod of the run; each pod's index comes from JOB_COMPLETION_INDEX."""
    dataset = spec.dataset.model_copy(update={"tokenizer": spec.dataset.tokenizer or spec.model.path})
    return ExtractConfig(
        runId=spec.output_run_id(),
        dataset=dataset,
        output=spec.output,
        validation=spec.validation,
        responses=spec.responses,
        generation=spec.generation,
        concurrency=spec.concurrency,
        serverUrl=f"http://127.0.0.1:{spec.server.port}",
        # As long as the server's startup probe lets it load (a big model takes more than 10 minutes).
        serverStartTimeoutSeconds=float(spec.server.startupTimeoutSeconds),
        engine=spec.server.engine,
        dumpDir=DUMP_DIR,
        dumpDirMaxBytes=spec.extractor.dumpDirMaxBytes,
        modelPath=spec.model.path,
        auxLayerIds=spec.model.auxLayerIds or None,
        finalState=spec.model.finalState,
        replicaCount=spec.parallelism,
        workers=extractor_workers(spec),
        progressPort=spec.extractor.progressPort,
        progressHost="0.0.0.0",
        terminationMessagePath="/dev/termination-log",
    )


def desired_config_map(owner: Owner, spec: ExtractionJobSpec) -> dict[str, Any]:
    # No replicaIndex: the extractor takes it from JOB_COMPLETION_INDEX only when the file leaves it out.
    config = extract_config(spec).model_dump(mode="json", exclude_none=True, exclude={"replicaIndex"})
    text = yaml.safe_dump(config, sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(owner.name, spec.runId),
            "namespace": owner.namespace,
            "labels": labels(owner, spec),
            "ownerReferences": [owner.reference()],
        },
        "data": {CONFIG_FILE: text},
    }


def server_argv(spec: ExtractionJobSpec, node_rank: int | str = 0, dist_init_addr: str | None = None) -> list[str]:
    """The server's command line of extraction mode, built by the engine's own launcher. With
    server.nodes > 1 it is rank ``node_rank`` of a server whose leader listens at ``dist_init_addr``.

    One source of truth for the flags extraction needs (docs/sglang.md, docs/vllm.md); it also
    refuses ``extraArgs`` that would override them. vLLM's is hsx's launcher, which reads the
    model's config in the pod and execs vLLM (the operator never sees the model).
    """
    tp = spec.tensor_parallel()
    if spec.server.engine == "vllm":
        return vllm_launch.launcher_args(
            spec.model.path, tp, spec.server.port, spec.model.auxLayerIds or None, spec.server.extraArgs,
            host="127.0.0.1",
        )  # fmt: skip
    return sglang_launch.server_args(
        spec.model.path,
        tp * spec.server.nodes,  # SGLang's --tp counts every node's GPUs
        spec.server.port,
        spec.model.auxLayerIds or None,
        spec.server.extraArgs,
        # Only the extractor, in the same pod network, may talk to the server: its routes include
        # admin ones and it takes any prompt. The kubelet probes it from inside (health_probe).
        host="127.0.0.1",
        dp=spec.server.gpus // tp,
        nodes=spec.server.nodes,
        node_rank=node_rank,
        dist_init_addr=dist_init_addr,
    )


def server_command(spec: ExtractionJobSpec, node_rank: int = 0, dist_init_addr: str | None = None) -> list[str]:
    """server_argv as a container command: literal, except the leader's address, whose $(VAR) the pod expands."""
    return [a if a == dist_init_addr else literal_arg(a) for a in server_argv(spec, node_rank, dist_init_addr)]


def literal_arg(arg: str) -> str:
    """``arg`` as a container command entry the kubelet passes on unchanged: it expands ``$(VAR)``
    and turns ``$$`` into ``$``, so every ``$`` is doubled (a user's extraArgs and paths are text)."""
    return arg.replace("$", "$$")


def _server_env(spec: ExtractionJobSpec) -> dict[str, str]:
    if spec.server.engine == "vllm":
        return vllm_launch.server_env(DUMP_DIR)
    return sglang_launch.server_env(DUMP_DIR, final_state=spec.model.finalState or protocol.FINAL_POST_NORM)


def health_probe(port: int) -> dict[str, Any]:
    """Probe action for a server bound to the pod's 127.0.0.1: an exec in the server container
    (httpGet would come from the kubelet to the pod IP). Only the standard library of the image's
    python3, so it runs in any SGLang or vLLM image (both serve /health)."""
    check = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=4)"
    return {"exec": {"command": ["python3", "-c", check]}}


def _startup_probe(spec: ExtractionJobSpec) -> dict[str, Any]:
    budget = spec.server.startupTimeoutSeconds
    period = 10 if budget >= 300 else 2
    return {
        **health_probe(spec.server.port),
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": max(1, math.ceil(budget / period)),
    }


def _local_dir(uri: str) -> str | None:
    """The node directory behind a local (non-S3) URI, for a hostPath mount; None for S3."""
    if uri.startswith("s3://"):
        return None
    path = uri.removeprefix("file://")
    return path if path.startswith("/") else None


def _on_model_volume(spec: ExtractionJobSpec, path: str) -> bool:
    """Whether ``path`` lies on the model volume (mounted at ``model.mountPath`` when a source is set)."""
    return spec.model.source is not None and under(path, spec.model.mountPath)


def _volumes(
    spec: ExtractionJobSpec, owner: Owner
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, server mounts, extractor mounts)."""
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.server.shmSize}},
        {"name": "config", "configMap": {"name": config_map_name(owner.name, spec.runId)}},
        {"name": "scratch", "emptyDir": {"sizeLimit": str(scratch_size_limit(spec))}},
    ]
    server_mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": SHM_DIR}]
    extractor_mounts: list[dict[str, Any]] = [
        {"name": "shm", "mountPath": SHM_DIR},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "scratch", "mountPath": SCRATCH_DIR},
    ]
    source = spec.model.source
    if source is not None:
        if source.pvc is not None:
            vol: dict[str, Any] = {
                "persistentVolumeClaim": {"claimName": source.pvc.claimName, "readOnly": True}
            }
        elif source.hostPath is not None:
            vol = {"hostPath": {"path": source.hostPath.path, "type": "Directory"}}
        else:
            assert source.image is not None  # the CRD requires exactly one source
            vol = {"image": {"reference": source.image.reference, "pullPolicy": source.image.pullPolicy}}
        volumes.append({"name": "model", **vol})
        mount: dict[str, Any] = {"name": "model", "mountPath": spec.model.mountPath, "readOnly": True}
        if source.pvc is not None and source.pvc.subPath:
            mount["subPath"] = source.pvc.subPath
        server_mounts.append(mount)
        extractor_mounts.append(dict(mount))
    # A local dataset under the model's mount is read from the model volume (a dataset beside the
    # weights on one PVC); other local paths (single-node clusters, demos) are mounted from the node,
    # if the admin's policy allows (policy.py).
    dataset_file = _local_dir(spec.dataset.uri)
    if dataset_file is not None and not _on_model_volume(spec, dataset_file):
        directory = posixpath.dirname(dataset_file)
        volumes.append({"name": "dataset", "hostPath": {"path": directory, "type": "Directory"}})
        extractor_mounts.append({"name": "dataset", "mountPath": directory, "readOnly": True})
    output_dir = _local_dir(spec.output.uri)
    if output_dir is not None and _on_model_volume(spec, output_dir):
        raise ValueError(
            f"spec.output.uri {spec.output.uri} lies under model.mountPath {spec.model.mountPath}, "
            "which is mounted read-only"
        )
    if output_dir is not None:
        volumes.append({"name": "output", "hostPath": {"path": output_dir, "type": "DirectoryOrCreate"}})
        extractor_mounts.append({"name": "output", "mountPath": output_dir})
    return volumes, server_mounts, extractor_mounts


def _secret_env(secret: str | None, names: tuple[str, str, str]) -> list[dict[str, Any]]:
    """AWS credentials from ``secret``'s standard keys into ``names`` (the session token is optional)."""
    if not secret:
        return []
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    return [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": key == keys[2]}}}
        for name, key in zip(names, keys, strict=True)
    ]


def _credentials_env(spec: ExtractionJobSpec) -> list[dict[str, Any]]:
    """The output's credentials as the AWS chain reads them; the dataset's own apart (contract)."""
    own = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    return [
        *_secret_env(spec.output.credentialsSecret, own),
        *_secret_env(spec.dataset.credentialsSecret, DATASET_CREDENTIALS_ENV),
    ]


def _resources(
    requests: dict[str, str], limits: dict[str, str], defaults: dict[str, str] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    requests = {**{k: v for k, v in (defaults or {}).items() if k not in limits}, **requests}
    if requests:
        out["requests"] = dict(requests)
    if limits:
        out["limits"] = dict(limits)
    return out


def desired_job(
    owner: Owner, spec: ExtractionJobSpec, *, suspend: bool | None = None, dist_init_addr: str | None = None
) -> dict[str, Any]:
    """The run's batch/v1 Job. ``suspend`` overrides the initial suspend flag (Kueue); ``dist_init_addr``
    is the leader's address when its server spans nodes (group.desired_jobset)."""
    volumes, server_mounts, extractor_mounts = _volumes(spec, owner)
    gpus = str(spec.server.gpus)
    server_resources = _resources(
        spec.server.resources.requests, spec.server.resources.limits, server_default_requests(spec.server.gpus)
    )
    server_resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
    server_resources.setdefault("requests", {})[GPU_RESOURCE] = gpus
    server = {
        "name": SERVER_CONTAINERS[spec.server.engine],
        "image": spec.server_image(),
        "imagePullPolicy": spec.server.imagePullPolicy,
        "command": server_command(spec, 0, dist_init_addr),
        # A native sidecar: starts first, runs for the pod's life, does not block completion.
        "restartPolicy": "Always",
        "env": [
            *({"name": k, "value": v} for k, v in _server_env(spec).items()),
            *(e.model_dump() for e in spec.server.env),
        ],
        # A server that dies says why in its status (the tail of its log): the operator reports it.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "startupProbe": _startup_probe(spec),
        "readinessProbe": {**health_probe(spec.server.port), "periodSeconds": 10, "timeoutSeconds": 5},
        "resources": server_resources,
        "volumeMounts": server_mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    extractor = {
        "name": EXTRACTOR_CONTAINER,
        "image": spec.extractor_image(),
        "imagePullPolicy": spec.extractor.imagePullPolicy,
        "command": ["hsx", "extract", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "env": [
            *(e.model_dump() for e in spec.extractor.env),
            {"name": "TMPDIR", "value": SCRATCH_DIR},
            *_credentials_env(spec),
        ],
        "ports": [{"name": "progress", "containerPort": spec.extractor.progressPort}],
        "resources": _resources(
            spec.extractor.resources.requests, spec.extractor.resources.limits, EXTRACTOR_DEFAULT_REQUESTS
        ),
        "volumeMounts": extractor_mounts,
        # The extractor writes its final progress here; the operator reads it after the pod ends.
        "terminationMessagePolicy": "File",
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": EXTRACTOR_UID,
            "runAsGroup": EXTRACTOR_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    # First init container: a wrong tokenizer, dataset or bucket fails the pod before the GPUs load weights.
    preflight = {
        **{k: v for k, v in extractor.items() if k != "ports"},
        "name": PREFLIGHT_CONTAINER,
        "command": ["hsx", "preflight", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
    }
    sched = spec.scheduling
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [preflight, server],
        "containers": [extractor],
        "volumes": volumes,
    }
    if sched.nodeSelector:
        pod_spec["nodeSelector"] = dict(sched.nodeSelector)
    if sched.tolerations:
        pod_spec["tolerations"] = [t.model_dump(exclude_none=True) for t in sched.tolerations]
    if sched.affinity:
        pod_spec["affinity"] = sched.affinity
    if sched.priorityClassName:
        pod_spec["priorityClassName"] = sched.priorityClassName
    apply_pod_settings(spec.pod, pod_spec, [preflight, extractor])
    job_labels = labels(owner, spec)
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": spec.parallelism,
        "parallelism": spec.parallelism,
        "backoffLimit": spec.backoffLimit,
        # Never two pods of one index at once: an 8-GPU pod must be gone before its replacement starts.
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {
            "rules": [
                *(
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": name, "operator": "In", "values": [EXIT_PERMANENT]},
                    }
                    for name in (PREFLIGHT_CONTAINER, EXTRACTOR_CONTAINER)
                ),
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "suspend": spec.suspend if suspend is None else suspend,
        "template": {
            "metadata": {
                # The user's own first: hsx's keys always win (the CRD refuses user keys with its prefixes).
                "labels": {**spec.pod.labels, **job_labels},
                "annotations": {
                    **spec.pod.annotations,
                    **spec.scheduling.topology_annotations(),
                    "kubectl.kubernetes.io/default-container": EXTRACTOR_CONTAINER,
                },
            },
            "spec": pod_spec,
        },
    }
    if spec.activeDeadlineSeconds is not None:
        job_spec["activeDeadlineSeconds"] = spec.activeDeadlineSeconds
    if spec.ttlSecondsAfterFinished is not None:
        job_spec["ttlSecondsAfterFinished"] = spec.ttlSecondsAfterFinished
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(owner.name, spec.runId),
            "namespace": owner.namespace,
            "labels": job_labels,
            "ownerReferences": [owner.reference()],
        },
        "spec": job_spec,
    }


def with_queue_label(spec: ExtractionJobSpec, xj_labels: Mapping[str, str] | None) -> ExtractionJobSpec:
    """Kueue's convention (RayJob, JobSet, TrainJob): the ExtractionJob's own kueue.x-k8s.io/queue-name
    label names its queue, as spec.scheduling.queueName does (which wins when both are set)."""
    queue = (xj_labels or {}).get(LABEL_QUEUE)
    if not queue or spec.scheduling.queueName:
        return spec
    return spec.model_copy(update={"scheduling": spec.scheduling.model_copy(update={"queueName": queue})})


def initial_suspend(spec: ExtractionJobSpec) -> bool:
    """A queued Job starts suspended: Kueue admits it by unsuspending."""
    return spec.suspend or bool(spec.scheduling.queueName)
