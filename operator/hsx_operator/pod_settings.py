"""Settings passed through to the run's pods, narrow and validated: the spec's ``pod`` block (what a cluster
needs of a pod: its identity, pull secrets, labels, runtime class, a private CA) and the containers' own
environment and resources."""

from __future__ import annotations

import posixpath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from hsx_extractor.contract import DATASET_CREDENTIALS_ENV
from hsx_operator.cel import cel

DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Label and annotation keys hsx sets itself, which a user's must not replace.
RESERVED_PREFIXES = ("hsx.dev/", "app.kubernetes.io/", "kueue.x-k8s.io/", "batch.kubernetes.io/")
# Bounded so the spec's CEL rules stay within the API server's cost budget (it prices by maximum size).
_LABELS: dict[str, Any] = {"maxProperties": 16, "additionalProperties": {"type": "string", "maxLength": 63}}
_ANNOTATIONS: dict[str, Any] = {"maxProperties": 16, "additionalProperties": {"type": "string", "maxLength": 1024}}
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
MAX_TEXT = 4096  # the longest free-text field of a spec
# What hsx sets in the extractor's environment itself (desired.py: scratch, the S3 CA, credentials, the
# dataset's credentials): a user's extractor.env may not replace it.
EXTRACTOR_OWN_ENV = (
    "TMPDIR", "AWS_CA_BUNDLE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", *DATASET_CREDENTIALS_ENV,
)  # fmt: skip
EXTRACTOR_ENV_DOC = (
    "Extra environment of the extractor and its preflight (a proxy: HTTPS_PROXY, NO_PROXY; the AWS SDK's own "
    f"settings such as AWS_STS_REGIONAL_ENDPOINTS). hsx's own names are refused: {', '.join(EXTRACTOR_OWN_ENV)}."
)
EXTRACTOR_ENV_RULE = cel(
    "self.all(e, !(e.name in [" + ", ".join(f"'{n}'" for n in EXTRACTOR_OWN_ENV) + "]))",
    f"extractor.env may not set hsx's own variables ({', '.join(EXTRACTOR_OWN_ENV)})",
)
# Where a CA bundle from a ConfigMap is mounted in the extractor's containers.
# Beside, not inside, the config ConfigMap at /etc/hsx: a read-only volume cannot hold another mount point.
CA_DIR = "/etc/hsx-ca"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ABS_PATH = r"^/.*$"


class ExtraVolume(_Spec):
    """A ConfigMap, Secret or PersistentVolumeClaim mounted into the extractor and its preflight (a tokenizer
    override, a dataset on a PVC, a client certificate). Exactly one source."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "[has(self.configMap), has(self.secret), has(self.persistentVolumeClaim)].filter(x, x).size() == 1",
                    "pod.volumes[] needs exactly one of configMap, secret or persistentVolumeClaim",
                )
            ]
        }
    )
    name: str = Field(description="Volume name, unique in the list (the pod's volume is user-NAME).",
                      max_length=48, pattern=DNS_LABEL_PATTERN)  # fmt: skip
    mountPath: str = Field(description="Absolute path in the extractor's containers; not over a path hsx mounts.",
                           max_length=256, pattern=ABS_PATH)  # fmt: skip
    readOnly: bool = Field(default=True, description="Mount read-only (the default).")
    configMap: str | None = Field(default=None, description="A ConfigMap of the job's namespace.", max_length=253,
                                  pattern=DNS_SUBDOMAIN_PATTERN)  # fmt: skip
    secret: str | None = Field(default=None, description="A Secret of the job's namespace.", max_length=253,
                               pattern=DNS_SUBDOMAIN_PATTERN)  # fmt: skip
    persistentVolumeClaim: str | None = Field(default=None, description="A PersistentVolumeClaim of the job's "
                                              "namespace.", max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)  # fmt: skip

    @model_validator(mode="after")
    def _one_source(self) -> ExtraVolume:  # the CRD's CEL rule, for hsx render and preflight too
        if sum(x is not None for x in (self.configMap, self.secret, self.persistentVolumeClaim)) != 1:
            raise ValueError("pod.volumes[] needs exactly one of configMap, secret or persistentVolumeClaim")
        return self

    def source(self) -> dict[str, Any]:
        """The Pod API's volume source."""
        if self.configMap:
            return {"configMap": {"name": self.configMap}}
        if self.secret:
            return {"secret": {"secretName": self.secret}}
        return {"persistentVolumeClaim": {"claimName": self.persistentVolumeClaim, "readOnly": self.readOnly}}


class PodSettings(_Spec):
    """Settings of every pod of the run, passed through as the Pod API has them."""

    serviceAccountName: str | None = Field(
        default=None,
        description="ServiceAccount the pods run as: cloud identity for S3 without keys (EKS IRSA or Pod Identity, GKE "
        "and Azure workload identity inject their credentials for it; leave output.credentialsSecret unset and the "
        "SDK's default chain finds them). The Kubernetes API token itself stays unmounted. Default: the namespace's "
        "default account.",
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
    )
    imagePullSecrets: list[str] = Field(
        default_factory=list,
        description="Secrets (type kubernetes.io/dockerconfigjson) in the job's namespace for pulling the server, "
        "extractor and model images from private registries.",
        max_length=16,
        json_schema_extra={"items": {"type": "string", "maxLength": 253, "pattern": DNS_SUBDOMAIN_PATTERN}},
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Extra labels of the pods (cost allocation, network policies); hsx's own keys are refused.",
        json_schema_extra=_LABELS,
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Extra annotations of the pods (service meshes, monitoring agents); hsx's own keys are refused.",
        json_schema_extra=_ANNOTATIONS,
    )
    runtimeClassName: str | None = Field(
        default=None,
        description="RuntimeClass of the pods (e.g. nvidia where the GPU runtime is not the node's default).",
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
    )
    # Two scalars, not an optional object: the API server prices optional objects in CEL as unbounded.
    caBundleConfigMap: str | None = Field(
        default=None,
        description=f"A ConfigMap in the job's namespace holding a PEM bundle of CAs the extractor trusts for HTTPS to "
        f"S3 (an on-prem store signed by a private CA): mounted under {CA_DIR} and named by AWS_CA_BUNDLE.",
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
    )
    caBundleKey: str = Field(
        default="ca.crt",
        description="The key of caBundleConfigMap holding the bundle.",
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
    )
    volumes: list[ExtraVolume] = Field(
        default_factory=list,
        description="Extra volumes of the extractor and its preflight (ConfigMaps, Secrets, PVCs); the server's "
        "container does not see them.",
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    # A key check in CEL would price every key at the largest request: the operator checks it (InvalidSpec).
    @field_validator("labels", "annotations")
    @classmethod
    def _no_reserved_keys(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        taken = sorted(k for k in value if k.startswith(RESERVED_PREFIXES))
        if taken:
            raise ValueError(f"pod.{info.field_name} must not use hsx's own prefixes {', '.join(RESERVED_PREFIXES)}: {taken}")
        return value


class EnvVar(_Spec):
    """One environment variable with a literal value."""

    name: str = Field(description="Variable name.", pattern=ENV_NAME_PATTERN, max_length=256)
    value: str = Field(default="", description="Variable value.", max_length=MAX_TEXT)


# Resource name -> quantity, as a Pod spec has them; bounded so CEL's cost estimate stays small.
_QUANTITIES: dict[str, Any] = {
    "additionalProperties": {"type": "string", "pattern": QUANTITY_PATTERN, "maxLength": 64},
    "maxProperties": 16,
}


class Resources(_Spec):
    """Compute resources of one container, as in a Pod spec (quantities such as 32, 500m, 64Gi)."""

    requests: dict[str, str] = Field(
        default_factory=dict,
        description="Minimum resources the scheduler reserves, by resource name.",
        json_schema_extra=_QUANTITIES,
    )
    limits: dict[str, str] = Field(
        default_factory=dict, description="Maximum resources, by resource name.", json_schema_extra=_QUANTITIES
    )


def apply_pod_settings(pod: PodSettings, pod_spec: dict[str, Any], extractors: list[dict[str, Any]]) -> None:
    """spec.pod into the pod: identity, pull secrets, runtime class, and the CA bundle in the containers
    that reach S3 (preflight and extractor)."""
    if pod.serviceAccountName:
        pod_spec["serviceAccountName"] = pod.serviceAccountName  # its API token stays unmounted
    if pod.imagePullSecrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in pod.imagePullSecrets]
    if pod.runtimeClassName:
        pod_spec["runtimeClassName"] = pod.runtimeClassName
    if pod.caBundleConfigMap:
        pod_spec["volumes"].append({"name": "ca-bundle", "configMap": {"name": pod.caBundleConfigMap}})
        for container in extractors:  # new lists: preflight was copied from the extractor, sharing them
            mount = {"name": "ca-bundle", "mountPath": CA_DIR, "readOnly": True}
            container["volumeMounts"] = [*container["volumeMounts"], mount]
            container["env"] = [*container["env"], {"name": "AWS_CA_BUNDLE", "value": f"{CA_DIR}/{pod.caBundleKey}"}]
    taken = sorted({m["mountPath"] for c in extractors for m in c["volumeMounts"]})
    for i, extra in enumerate(pod.volumes):
        clash = next((t for t in taken if _overlaps(extra.mountPath, t)), None)
        if clash is not None:
            raise ValueError(f"pod.volumes[{i}].mountPath {extra.mountPath} overlaps {clash}, where hsx mounts its own")
        taken.append(extra.mountPath)  # nor over one another
        pod_spec["volumes"].append({"name": f"user-{extra.name}", **extra.source()})
        mount = {"name": f"user-{extra.name}", "mountPath": extra.mountPath, "readOnly": extra.readOnly}
        for container in extractors:
            container["volumeMounts"] = [*container["volumeMounts"], mount]


def _overlaps(path: str, other: str) -> bool:
    """One path is the other or lies inside it (whole components)."""
    a, b = posixpath.normpath(path), posixpath.normpath(other)
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")
