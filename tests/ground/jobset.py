"""JobSet's real controller manager on the test ground, installed as its manifests install it.

The binary and its CRD are built by tests/cluster/build.sh from the module pinned in tests/cluster/jobset/go.mod.
It runs as a Deployment in jobset-system on the node agent (image `registry.k8s.io/jobset/jobset:*` -> the built
binary) with its config from a ConfigMap and its webhook serving certificate from a Secret. As for Kueue
(tests/ground/kueue.py): its admission webhooks are not registered (the ground has no Service routing for the API
server to reach a pod, so hsx sets every field JobSet's defaulting webhook would: group.desired_jobset), and it
holds cluster-admin instead of its own ClusterRole. The ground has no cluster DNS either, so pods of a JobSet do
not resolve one another's hostnames here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.ground.kueue import controller_installed, tls_secret
from tests.ground.pki import CertificateAuthority
from tests.ground.tools import tool_path

NAMESPACE = "jobset-system"
IMAGE = "registry.k8s.io/jobset/jobset:v0.11.1"
DEPLOYMENT = "jobset-controller-manager"
CONFIG = {
    "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
    "kind": "Configuration",
    "internalCertManagement": {"enable": False},
    "health": {"healthProbeBindAddress": ":8081"},
    "metrics": {"bindAddress": ":8443"},
    "webhook": {"port": 9443},
    "leaderElection": {"leaderElect": False},
}


def jobset_crds() -> Path:
    return tool_path("jobset").parent / "crds"


def manager_argv(container: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    assert container["command"] == ["/manager"], container["command"]
    return [str(tool_path("jobset")), *container.get("args", [])]


def manifests() -> list[dict[str, Any]]:
    ca = CertificateAuthority("jobset-test-ca")
    labels = {"control-plane": "controller-manager"}
    pod_spec = {
        "serviceAccountName": DEPLOYMENT,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
        "containers": [
            {
                "name": "manager",
                "image": IMAGE,
                "command": ["/manager"],
                "args": ["--config=/controller_manager_config.yaml", "--zap-log-level=2"],
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8081}, "periodSeconds": 2},
                "volumeMounts": [
                    {"name": "config", "mountPath": "/controller_manager_config.yaml",
                     "subPath": "controller_manager_config.yaml"},
                    {"name": "cert", "mountPath": "/tmp/k8s-webhook-server/serving-certs", "readOnly": True},
                ],
            }
        ],
        "volumes": [
            {"name": "config", "configMap": {"name": "jobset-manager-config"}},
            {"name": "cert", "secret": {"secretName": "jobset-webhook-server-cert"}},
        ],
    }  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": DEPLOYMENT, "namespace": NAMESPACE}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "jobset-test-manager"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": DEPLOYMENT, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "jobset-manager-config", "namespace": NAMESPACE},
            "data": {"controller_manager_config.yaml": yaml.safe_dump(CONFIG)},
        },
        tls_secret("jobset-webhook-server-cert", NAMESPACE, f"jobset-webhook-service.{NAMESPACE}.svc", ca),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": DEPLOYMENT, "namespace": NAMESPACE},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        },
    ]


@contextlib.contextmanager
def jobset_installed(cluster: Any, node_agent: Any, timeout_s: float = 180) -> Iterator[None]:
    """JobSet's CRD and controller manager, Ready; all of it removed afterwards (the CRD too)."""
    with controller_installed(
        cluster, node_agent, "registry.k8s.io/jobset/jobset:*", manager_argv, jobset_crds(), manifests(),
        NAMESPACE, DEPLOYMENT, "jobset-test-manager", timeout_s,
    ):  # fmt: skip
        yield
