"""What a cluster admin sets once for every ExtractionJob, so a user's manifest names only model, dataset, output
and what differs (issue 33 item 2). Pure.

The chart's ``clusterDefaults`` values reach the operator as one JSON flag (``hsx-operator --cluster-defaults``);
:func:`with_cluster_defaults` fills them into a spec before ``desired`` renders the Job, so the admin's policy
(``policy.py``) checks the pod as it will run, defaults included. A field the ExtractionJob sets always wins:

* scalars (images, priority class, queue, CA bundle): the default only where the spec leaves the field unset;
* ``nodeSelector``: merged, the spec's keys win; ``tolerations`` and ``imagePullSecrets``: the admin's first,
  then the spec's own (a registry secret for hsx's images and a team's own secret both apply);
* the S3 store (``s3``: endpoint, region, path style) as one unit, for an ``s3://`` output that names no endpoint
  (a path style alone could not tell "unset" from its default).

The Job records which fields came from the defaults (annotation ``hsx.dev/cluster-defaults``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hsx_extractor.config import check_endpoint
from hsx_extractor.usage import describe_validation_error
from hsx_operator.api import DEFAULT_EXTRACTOR_IMAGE, DEFAULT_SERVER_IMAGES, ExtractionJobSpec
from hsx_operator.placement import Toleration
from hsx_operator.pod_settings import DNS_SUBDOMAIN_PATTERN

ANNOTATION = "hsx.dev/cluster-defaults"


class _Defaults(BaseModel):
    model_config = ConfigDict(extra="forbid")


class S3Store(_Defaults):
    endpoint: str = Field(min_length=1, description="S3 endpoint URL (an on-prem or non-AWS store).")
    region: str | None = Field(default=None, description="S3 region.")
    pathStyle: bool = Field(default=False, description="Path-style addressing (most on-prem stores).")

    _endpoint = field_validator("endpoint")(check_endpoint)


class ClusterDefaults(_Defaults):
    imageRegistry: str | None = Field(
        default=None,
        description="A mirror of hsx's images (registry.example.com/hsx): hsx's own server and extractor images are "
        "taken from it, same name and tag. serverImages and extractorImage win over it.",
    )
    serverImages: dict[Literal["sglang", "vllm"], str] = Field(
        default_factory=dict, description="The server image of each engine where spec.server.image is unset."
    )
    extractorImage: str | None = Field(default=None, description="The extractor image where spec.extractor.image is unset.")
    imagePullSecrets: list[str] = Field(default_factory=list, description="Pull secrets every run's pods get first.")
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Node labels; the spec's keys win.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations every run's pods get first.")
    priorityClassName: str | None = Field(default=None, description="Priority class where the spec names none.")
    queueName: str | None = Field(
        default=None, description="Kueue LocalQueue where neither the spec nor the kueue.x-k8s.io/queue-name label names one."
    )
    s3: S3Store | None = Field(default=None, description="The store of s3:// outputs that name no endpoint.")
    caBundleConfigMap: str | None = Field(
        default=None, description="A ConfigMap of CAs for HTTPS to S3 (in each job's namespace) where spec.pod names none."
    )
    caBundleKey: str = Field(default="ca.crt", description="The key of caBundleConfigMap holding the bundle.")

    @field_validator("imagePullSecrets")
    @classmethod
    def _secret_names(cls, value: list[str]) -> list[str]:
        bad = [n for n in value if not re.fullmatch(DNS_SUBDOMAIN_PATTERN, n)]
        if bad:
            raise ValueError(f"not Secret names: {bad}")
        return value

    @field_validator("priorityClassName", "queueName", "caBundleConfigMap")
    @classmethod
    def _object_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(DNS_SUBDOMAIN_PATTERN, value):
            raise ValueError(f"{value!r} is not a Kubernetes object name")
        return value

    @classmethod
    def from_json(cls, text: str) -> ClusterDefaults:
        """From the operator's flag; ValueError naming the field when the chart's values are wrong."""
        try:
            return cls.model_validate(json.loads(text or "{}") or {})
        except ValidationError as exc:  # before ValueError: it is one
            raise ValueError(f"--cluster-defaults: {describe_validation_error(exc, prefix='clusterDefaults')}") from None
        except ValueError as exc:
            raise ValueError(f"--cluster-defaults: not JSON ({exc})") from None


def mirrored(image: str, registry: str | None) -> str:
    """hsx's own ``image`` (registry/org/name:tag) from the mirror ``registry``: the same name and tag there."""
    return f"{registry.rstrip('/')}/{image.rsplit('/', 1)[-1]}" if registry else image


def with_cluster_defaults(spec: ExtractionJobSpec, defaults: ClusterDefaults) -> tuple[ExtractionJobSpec, list[str]]:
    """``spec`` with the admin's defaults where it leaves fields unset, and the spec fields they filled."""
    filled: list[str] = []
    server, extractor, scheduling, pod, output = spec.server, spec.extractor, spec.scheduling, spec.pod, spec.output
    if server.image is None and (defaults.serverImages.get(server.engine) or defaults.imageRegistry):
        image = defaults.serverImages.get(server.engine) or mirrored(DEFAULT_SERVER_IMAGES[server.engine], defaults.imageRegistry)
        server = server.model_copy(update={"image": image})
        filled.append("server.image")
    if extractor.image is None and (defaults.extractorImage or defaults.imageRegistry):
        image = defaults.extractorImage or mirrored(DEFAULT_EXTRACTOR_IMAGE, defaults.imageRegistry)
        extractor = extractor.model_copy(update={"image": image})
        filled.append("extractor.image")
    sched: dict[str, object] = {}
    if defaults.nodeSelector:
        sched["nodeSelector"] = {**defaults.nodeSelector, **scheduling.nodeSelector}
    if defaults.tolerations:
        sched["tolerations"] = [*defaults.tolerations, *(t for t in scheduling.tolerations if t not in defaults.tolerations)]
    if defaults.priorityClassName and not scheduling.priorityClassName:
        sched["priorityClassName"] = defaults.priorityClassName
    if defaults.queueName and not scheduling.queueName:
        sched["queueName"] = defaults.queueName
    if sched:
        scheduling = scheduling.model_copy(update=sched)
        filled += [f"scheduling.{name}" for name in sched]
    pods: dict[str, object] = {}
    if defaults.imagePullSecrets:
        pods["imagePullSecrets"] = [*defaults.imagePullSecrets, *(s for s in pod.imagePullSecrets if s not in defaults.imagePullSecrets)]
    if defaults.caBundleConfigMap and not pod.caBundleConfigMap:
        pods["caBundleConfigMap"] = defaults.caBundleConfigMap
    if pods:
        filled += [f"pod.{name}" for name in pods]
        if "caBundleConfigMap" in pods:
            pods["caBundleKey"] = defaults.caBundleKey
        pod = pod.model_copy(update=pods)
    # The admin's store only for outputs that name none of it: a region alone means AWS.
    if defaults.s3 is not None and output.uri.startswith("s3://") and output.endpoint is None and output.region is None:
        output = output.model_copy(update=defaults.s3.model_dump())
        filled.append("output.endpoint")
    if not filled:
        return spec, []
    updated = spec.model_copy(
        update={"server": server, "extractor": extractor, "scheduling": scheduling, "pod": pod, "output": output}
    )
    # Validated as a whole, as the spec's own fields were (model_copy checks nothing).
    return ExtractionJobSpec.model_validate(updated.model_dump(exclude_unset=False)), filled


def annotate(job: dict[str, Any], filled: list[str]) -> dict[str, Any]:
    """The Job with the fields the defaults filled in its annotation (for whoever reads the Job)."""
    if filled:
        job["metadata"].setdefault("annotations", {})[ANNOTATION] = ",".join(filled)
    return job


def read_defaults(value: str) -> ClusterDefaults:
    """``--cluster-defaults`` of ``hsx render``: the JSON itself, or ``@FILE`` holding it (or the chart's YAML block)."""
    if not value.startswith("@"):
        return ClusterDefaults.from_json(value)
    import yaml

    try:
        loaded = yaml.safe_load(Path(value[1:]).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--cluster-defaults {value}: {exc}") from None
    if isinstance(loaded, dict) and "clusterDefaults" in loaded:  # the chart's values file: its block
        loaded = loaded["clusterDefaults"] or {}
    return ClusterDefaults.from_json(json.dumps(loaded))
