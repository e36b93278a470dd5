"""The operator's permissions, least privilege. docs/rbac.md explains each rule; the cluster tests run
the operator with exactly these and nothing more."""

from __future__ import annotations

from typing import Any

from hsx_operator.api import GROUP, PLURAL

# Per namespace the operator watches (a Role there, or a ClusterRole for all namespaces).
NAMESPACED_RULES: list[dict[str, Any]] = [
    # Watch ExtractionJobs; kopf patches metadata (its finalizer and bookkeeping annotations). Never spec.
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    # One Job per run; patch for suspend/resume and the startup deadline; delete for superseded runs and finalization.
    {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # One JobSet per run whose server spans nodes (server.nodes > 1), with the same uses.
    {
        "apiGroups": ["jobset.x-k8s.io"],
        "resources": ["jobsets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # The extractor's config of each run (owned by the ExtractionJob, collected by the garbage collector).
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create"]},
    # Pod state and the events of pending pods explain a stuck run.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    # Kueue's Workload of a queued Job: Queued only when Kueue really holds it (read-only; absent without Kueue).
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["get", "list"]},
]

# Cluster-wide, read-only: kopf discovers the CRD and (when watching all namespaces) lists namespaces.
DISCOVERY_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
]

# Only with --peering NAME.
PEERING_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["get", "list", "watch", "patch"]},
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    },
]


def cluster_role(name: str, *, peering: bool = False) -> dict[str, Any]:
    """A ClusterRole with every rule the operator needs to watch all namespaces."""
    rules = NAMESPACED_RULES + DISCOVERY_RULES + (PEERING_RULES if peering else [])
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": rules,
    }
