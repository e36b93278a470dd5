"""What the cluster admin lets an ExtractionJob's author reach on the node. Pure functions.

An ExtractionJob author is not a node admin: a hostPath volume of ``/`` reads the node's
credentials, and a ``system-node-critical`` pod evicts others. So the operator checks the pod it
is about to create, not the spec, against the admin's policy (the chart's ``policy`` values ->
``hsx-operator --allow-host-path/--allow-priority-class``): whatever ``desired`` renders is what
is checked, and nothing in between can drift.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The spec field behind each hostPath volume ``desired`` renders, for messages.
VOLUME_FIELDS = {
    "model": "spec.model.source.hostPath.path",
    "dataset": "spec.dataset.uri",
    "output": "spec.output.uri",
}
# Kubernetes' built-in classes: reserved for the node's own components.
SYSTEM_PRIORITY_PREFIX = "system-"


@dataclass(frozen=True)
class NodeAccessPolicy:
    """The admin's allow-lists. Empty: no hostPath volume, no system-* priority class."""

    host_path_prefixes: tuple[str, ...] = ()
    priority_classes: tuple[str, ...] = ()
    # Image references the pods may run (registry/repository prefixes); empty: any image. The pods carry
    # the AWS keys of the Secrets a spec names, so an admin may want them only in images they trust.
    image_prefixes: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, host_paths: Iterable[str] = (), priority_classes: Iterable[str] = (), image_prefixes: Iterable[str] = ()
    ) -> NodeAccessPolicy:
        """From the operator's flags; a prefix must be an absolute path ("/" allows every path)."""
        prefixes = []
        for raw in host_paths:
            if not raw.startswith("/"):
                raise ValueError(f"--allow-host-path {raw!r}: a host path prefix must be absolute")
            prefixes.append(posixpath.normpath(raw))
        images = tuple(image_prefixes)
        for raw in images:
            if not raw or "/" not in raw:
                raise ValueError(f"--allow-image-prefix {raw!r}: give a registry or repository prefix such as registry.example.com/ml/")
        return cls(tuple(prefixes), tuple(priority_classes), images)


def image_allowed(reference: str, prefixes: tuple[str, ...]) -> bool:
    """Whether an image reference starts with an allowed prefix, component-wise: a prefix ends at a
    path separator, so ghcr.io/hsx-dev does not allow ghcr.io/hsx-devil/x."""
    return not prefixes or any(
        reference.startswith(p) if p.endswith(("/", ":", "@")) else reference.startswith(p + "/") or reference == p
        for p in prefixes
    )


def under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or inside it, component-wise (``/data2`` is not under ``/data``)."""
    path, prefix = posixpath.normpath(path), posixpath.normpath(prefix)
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def violations(pod_spec: Mapping[str, Any], policy: NodeAccessPolicy) -> list[str]:
    """Why the admin's policy forbids this pod; empty when it may run."""
    found = []
    for volume in pod_spec.get("volumes") or []:
        host = volume.get("hostPath")
        if host is None:
            continue
        path = host["path"]
        field = VOLUME_FIELDS.get(volume["name"], f"volume {volume['name']}")
        if not any(under(path, prefix) for prefix in policy.host_path_prefixes):
            allowed = ", ".join(policy.host_path_prefixes) or "none"
            found.append(
                f"{field} mounts host path {path}, which the operator does not allow (allowed prefixes: {allowed}); "
                "use a PVC or S3, or ask the cluster admin to add the path to the hsx chart's "
                "policy.allowedHostPaths"
            )
    containers = [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]
    images = {c["image"]: c["name"] for c in containers}
    images.update({v["image"]["reference"]: "model volume" for v in pod_spec.get("volumes") or [] if "image" in v})
    for image, used_by in images.items():
        if not image_allowed(image, policy.image_prefixes):
            found.append(
                f"the {used_by} image {image} is not under the registries the operator allows "
                f"({', '.join(policy.image_prefixes)}); use an allowed image, or ask the cluster admin to add it to "
                "the hsx chart's policy.allowedImagePrefixes"
            )
    priority = pod_spec.get("priorityClassName")
    if priority and priority.startswith(SYSTEM_PRIORITY_PREFIX) and priority not in policy.priority_classes:
        found.append(
            f"spec.scheduling.priorityClassName {priority} is reserved for node components; use a class of your "
            "own, or ask the cluster admin to add it to the hsx chart's policy.allowedPriorityClasses"
        )
    return found
