"""Kueue's real controller manager on the test ground, installed as its manifests install it.

The binary and its CRDs are built by tests/cluster/build.sh from the module pinned in tests/cluster/kueue/go.mod.
It runs as a Deployment in kueue-system on the node agent (image `registry.k8s.io/kueue/kueue:*` -> the built
binary), with its config from a ConfigMap and its serving certificates from Secrets, as Kueue's own kustomize
manifests mount them. Two differences, both because the ground has no Service routing for the API server to
reach a pod: its admission webhooks are not registered (hsx's operator creates a queued Job suspended and
labelled, which is what Kueue's Job webhook would make of it), and it holds cluster-admin instead of its own
ClusterRole (its RBAC is not under test).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.ground.pki import CertificateAuthority
from tests.ground.tools import tool_path
from tests.ground.wait import wait_for

NAMESPACE = "kueue-system"
IMAGE = "registry.k8s.io/kueue/kueue:v0.17.0"
CONFIG = {
    "apiVersion": "config.kueue.x-k8s.io/v1beta2",
    "kind": "Configuration",
    "namespace": NAMESPACE,
    "manageJobsWithoutQueueName": False,
    "internalCertManagement": {"enable": False},
    "health": {"healthProbeBindAddress": ":8081"},
    "metrics": {"bindAddress": ":8443"},
    "webhook": {"port": 9443},
    "leaderElection": {"leaderElect": False},
    "integrations": {"frameworks": ["batch/job"]},
}


def kueue_dir() -> Path:
    return tool_path("kueue").parent


def manager_argv(container: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    assert container["command"] == ["/manager"], container["command"]
    return [str(tool_path("kueue")), *container.get("args", [])]


def _tls_secret(name: str, ca: CertificateAuthority) -> dict[str, Any]:
    return tls_secret(name, NAMESPACE, f"kueue-webhook-service.{NAMESPACE}.svc", ca)


def tls_secret(name: str, namespace: str, dns_name: str, ca: CertificateAuthority) -> dict[str, Any]:
    """A serving certificate as the Secret a controller's manifests mount (cert-manager's shape)."""
    pair = ca.issue(name, dns_names=[dns_name], server=True)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": namespace},
        "stringData": {"tls.crt": pair.cert_pem.decode(), "tls.key": pair.key_pem.decode()},
    }


def manifests(frameworks: tuple[str, ...] = ("batch/job",)) -> list[dict[str, Any]]:
    ca = CertificateAuthority("kueue-test-ca")
    config = {**CONFIG, "integrations": {"frameworks": list(frameworks)}}
    labels = {"control-plane": "controller-manager"}
    pod_spec = {
        "serviceAccountName": "kueue-controller-manager",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
        "containers": [
            {
                "name": "manager",
                "image": IMAGE,
                "command": ["/manager"],
                "args": ["--config=/controller_manager_config.yaml", "--zap-log-level=2"],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8081}, "periodSeconds": 2},
                "volumeMounts": [
                    {"name": "config", "mountPath": "/controller_manager_config.yaml",
                     "subPath": "controller_manager_config.yaml"},
                    {"name": "webhook-cert", "mountPath": "/tmp/k8s-webhook-server/serving-certs",
                     "readOnly": True},
                    {"name": "metrics-cert", "mountPath": "/etc/kueue/metrics/certs", "readOnly": True},
                    {"name": "visibility-cert", "mountPath": "/visibility", "readOnly": True},
                ],
            }
        ],
        "volumes": [
            {"name": "config", "configMap": {"name": "kueue-manager-config"}},
            {"name": "webhook-cert", "secret": {"secretName": "kueue-webhook-server-cert"}},
            {"name": "metrics-cert", "secret": {"secretName": "kueue-metrics-server-cert"}},
            {"name": "visibility-cert", "secret": {"secretName": "kueue-visibility-server-cert"}},
        ],
    }  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "kueue-controller-manager", "namespace": NAMESPACE},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kueue-test-manager"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": "kueue-controller-manager", "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "kueue-manager-config", "namespace": NAMESPACE},
            "data": {"controller_manager_config.yaml": yaml.safe_dump(config)},
        },
        _tls_secret("kueue-webhook-server-cert", ca),
        _tls_secret("kueue-metrics-server-cert", ca),
        _tls_secret("kueue-visibility-server-cert", ca),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "kueue-controller-manager", "namespace": NAMESPACE},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        },
    ]


def _available(cluster: Any, namespace: str, deployment: str) -> bool:
    out = cluster.kubectl("get", "deployment", "-n", namespace, deployment, "-o", "json", check=False)
    return out.returncode == 0 and (json.loads(out.stdout).get("status") or {}).get("availableReplicas") == 1


@contextlib.contextmanager
def kueue_installed(
    cluster: Any, node_agent: Any, timeout_s: float = 180, frameworks: tuple[str, ...] = ("batch/job",)
) -> Iterator[None]:
    """Kueue's CRDs and controller manager, Ready; everything of it removed afterwards (CRDs included:
    other tests check hsx on a cluster without Kueue). ``frameworks`` are the integrations it manages
    (a framework's CRD, JobSet's for jobset.x-k8s.io/jobset, must be installed before)."""
    with controller_installed(
        cluster, node_agent, "registry.k8s.io/kueue/kueue:*", manager_argv, kueue_dir() / "crds",
        manifests(frameworks), NAMESPACE, "kueue-controller-manager", "kueue-test-manager", timeout_s,
    ):  # fmt: skip
        yield


@contextlib.contextmanager
def controller_installed(
    cluster: Any,
    node_agent: Any,
    image: str,
    argv: Any,
    crds: Path,
    objects: list[dict[str, Any]],
    namespace: str,
    deployment: str,
    binding: str,
    timeout_s: float,
) -> Iterator[None]:
    """A controller's CRDs and Deployment (``objects``, in ``namespace``) installed and Ready, its image run
    by ``argv``; everything of it removed afterwards, CRDs included (Kueue's and JobSet's alike)."""
    node_agent.register_image(image, argv)
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(crds))
        for path in sorted(crds.glob("*.yaml")):
            cluster.wait_crd_established(yaml.safe_load(path.read_text())["metadata"]["name"])
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
        try:
            wait_for(lambda: _available(cluster, namespace, deployment), timeout_s, f"{deployment} to be available", 1.0)
        except AssertionError as exc:
            pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json", check=False).stdout
            raise AssertionError(f"{exc}; pods: {pods[-3000:]}") from exc
        yield
    finally:
        cluster.kubectl(
            "delete", "namespace", namespace, "--ignore-not-found", "--wait=true", "--timeout=100s", check=False
        )
        cluster.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found", check=False)
        release_leftovers(cluster, crds)
        cluster.kubectl("delete", "-f", str(crds), "--ignore-not-found", "--wait=true", "--timeout=100s", check=False)
        node_agent.unregister_image(image)


def release_leftovers(cluster: Any, crds: Path) -> None:
    """Kueue (and JobSet) put finalizers on its objects that only its (now stopped) manager removes; a CRD is not
    deleted while an object of it remains, so strip them."""
    for path in sorted(crds.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        kind = f"{crd['spec']['names']['plural']}.{crd['spec']['group']}"
        got = cluster.kubectl("get", kind, "-A", "-o", "json", check=False)
        if got.returncode != 0:
            continue
        for item in json.loads(got.stdout)["items"]:
            meta = item["metadata"]
            where = ["-n", meta["namespace"]] if meta.get("namespace") else []
            cluster.kubectl(
                "patch", kind, meta["name"], *where, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                check=False,
            )  # fmt: skip
