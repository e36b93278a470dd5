"""Where an ExtractionJob's pods may run and how they are queued: the spec's scheduling block."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hsx_operator.cel import cel

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


KUEUE_ANNOTATION_PREFIX = "kueue.x-k8s.io/"


class TopologyRequest(_Spec):
    """One topology domain for the pods (Kueue's podset-required-topology or podset-preferred-topology)."""

    level: str = Field(
        description="The node label naming the level's domains, for example cloud.provider.com/topology-rack.",
        min_length=1,
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
    )
    mode: Literal["Required", "Preferred"] = Field(
        default="Required", description="Required: wait for one domain with room; Preferred: fall back to several."
    )


class SchedulingSpec(_Spec):
    """Where the pods may run and how they are queued."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!has(self.topology) || has(self.queueName)", "scheduling.topology is Kueue's: set scheduling.queueName too"),
            ]
        }
    )

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
    topology: TopologyRequest | None = Field(
        default=None,
        description="Kueue topology-aware scheduling: the topology level (a node label of the cluster's Kueue "
        "Topology, for example a rack's) whose one domain holds each pod set. With server.nodes 2 and "
        "parallelism 1 the group's two pod sets share that one domain. Needs scheduling.queueName.",
    )

    def topology_annotations(self) -> dict[str, str]:
        """What Kueue reads from each pod template (its podset-*-topology annotations)."""
        if self.topology is None:
            return {}
        return {f"{KUEUE_ANNOTATION_PREFIX}podset-{self.topology.mode.lower()}-topology": self.topology.level}
