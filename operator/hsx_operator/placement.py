"""Where an ExtractionJob's pods may run and how they are queued: the spec's scheduling block."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_LIST = 64


class _Spec(BaseModel):
    # Unknown fields are errors, as in the rest of the spec.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Toleration(_Spec):
    """A Pod toleration (see the Pod API)."""

    key: str | None = Field(
        default=None,
        description="Taint key; empty with operator Exists tolerates everything.",
        max_length=316,
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value for operator Equal.", max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty tolerates all effects."
    )
    tolerationSeconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class SchedulingSpec(_Spec):
    """Where the pods may run and how they are queued."""

    nodeSelector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the pods require.",
        json_schema_extra={"maxProperties": 32, "additionalProperties": {"type": "string", "maxLength": 63}},
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the pods tolerate.", max_length=_LIST
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Pod affinity, as in the Pod API (nodeAffinity, podAffinity, podAntiAffinity); passed through as is.",
        json_schema_extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    )
    priorityClassName: str | None = Field(
        default=None, description="PriorityClass of the pods.", max_length=253
    )
    queueName: str | None = Field(
        default=None,
        description="Kueue LocalQueue: sets the kueue.x-k8s.io/queue-name label and creates the Job suspended so "
        "Kueue admits it.",
        max_length=63,
        pattern=LABEL_VALUE_PATTERN,
    )
