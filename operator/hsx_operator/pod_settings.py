"""The spec's ``pod`` block: pod-level settings passed through to every run pod, narrow and validated
(what a cluster needs of a pod: its identity, pull secrets, labels, runtime class, a private CA)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hsx_operator.cel import cel

DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Label and annotation keys hsx sets itself, which a user's must not replace.
RESERVED_PREFIXES = ("hsx.dev/", "app.kubernetes.io/", "kueue.x-k8s.io/", "batch.kubernetes.io/")
_MAP: dict[str, Any] = {"maxProperties": 32, "additionalProperties": {"type": "string", "maxLength": 4096}}
_NO_RESERVED_KEYS = " && ".join(f"!k.startsWith('{p}')" for p in RESERVED_PREFIXES)
# Where a CA bundle from a ConfigMap is mounted in the extractor's containers.
CA_DIR = "/etc/hsx/ca"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ConfigMapKey(_Spec):
    """One key of a ConfigMap in the job's namespace."""

    name: str = Field(description="ConfigMap name.", min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    key: str = Field(description="Key holding the PEM bundle.", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class PodSettings(_Spec):
    """Settings of every pod of the run, passed through as the Pod API has them."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"!has(self.labels) || self.labels.all(k, {_NO_RESERVED_KEYS})",
                    f"pod.labels must not use hsx's own prefixes {', '.join(RESERVED_PREFIXES)}"),
                cel(f"!has(self.annotations) || self.annotations.all(k, {_NO_RESERVED_KEYS})",
                    f"pod.annotations must not use hsx's own prefixes {', '.join(RESERVED_PREFIXES)}"),
            ]
        }
    )  # fmt: skip

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
        json_schema_extra=_MAP,
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Extra annotations of the pods (service meshes, monitoring agents).",
        json_schema_extra=_MAP,
    )
    runtimeClassName: str | None = Field(
        default=None,
        description="RuntimeClass of the pods (e.g. nvidia where the GPU runtime is not the node's default).",
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
    )
    caBundle: ConfigMapKey | None = Field(
        default=None,
        description=f"A PEM bundle of CAs the extractor trusts for HTTPS to S3 (an on-prem store signed by a private "
        f"CA): mounted under {CA_DIR} and named by AWS_CA_BUNDLE.",
    )
