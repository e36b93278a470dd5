"""The chart against the real control plane: a server-side dry run, then a real `helm install` whose operator
pod runs under the node agent (as the venv's `hsx-operator`, with the chart's ServiceAccount and RBAC) and
reconciles ExtractionJobs. The GitOps rerun story is checked on that operator:

* an unchanged apply changes nothing (generation, resourceVersion, the Job);
* the operator never writes spec (no perma-diff for Argo CD or Flux);
* a new runId starts a new run (a new Job);
* TTL cleanup of a finished run's Job never makes the operator create it again.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_operator.desired import LABEL_XJ
from tests.ground.images import OPERATOR_IMAGE, operator_argv
from tests.install.chart import CHART, helm, render_text
from tests.install.test_argocd_health import run_health

pytestmark = pytest.mark.cluster

# The one host path the installed operator allows (the chart's policy.allowedHostPaths).
MODEL_HOST_PATH = "/tmp/hsx-install-test-model"
POLL_SECONDS = 1
# How long a settled object must stay unwritten to count as settled: several operator polls.
QUIET_SECONDS = 6 * POLL_SECONDS


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 120.0, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def crds(kube_cluster: Any) -> None:
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    kube_cluster.wait_crd_established("extractionjobs.hsx.dev")


@pytest.mark.parametrize(
    "values",
    [
        {"rbac.namespaced": "false"},
        {"rbac.namespaced": "true"},
        {},
        {"replicaCount": "2", "peering.enabled": "true", "logLevel": "debug"},
    ],
    ids=["cluster-wide", "namespaced", "defaults", "peering"],
)
def test_rendered_chart_passes_a_server_side_dry_run(
    kube_cluster: Any, namespace: str, crds: None, values: dict[str, str], tmp_path: Path
) -> None:
    if values.get("rbac.namespaced") == "true":
        values = {**values, "watchNamespaces": f"{{{namespace}}}"}
    rendered = tmp_path / "chart.yaml"
    rendered.write_text(
        # helm test's pod names a ServiceAccount a dry run never creates; `helm test` below runs it for real.
        render_text(values, namespace=namespace, release=f"dry-{uuid.uuid4().hex[:6]}", with_tests=False)
    )
    result = kube_cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", str(rendered), check=False
    )
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    objects = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    assert result.stdout.count("(server dry run)") == len(objects), result.stdout


@dataclass
class Install:
    release: str
    namespace: str  # where the operator runs
    jobs_namespace: str  # the one namespace it watches


@pytest.fixture(scope="module")
def installed(kube_cluster: Any, node_agent: Any, crds: None) -> Iterator[Install]:
    suffix = uuid.uuid4().hex[:6]
    install = Install(f"hsx-{suffix}", f"hsx-system-{suffix}", f"hsx-jobs-{suffix}")
    kube_cluster.kubectl("create", "namespace", install.jobs_namespace)
    node_agent.register_image(OPERATOR_IMAGE, operator_argv)
    try:
        helm(
            "install", install.release, str(CHART),
            "--namespace", install.namespace, "--create-namespace",
            "--set", "rbac.namespaced=true",
            "--set", f"watchNamespaces={{{install.jobs_namespace}}}",
            "--set", f"pollSeconds={POLL_SECONDS}",
            "--set", f"policy.allowedHostPaths={{{MODEL_HOST_PATH}}}",
            "--wait", "--timeout", "240s",
            kubeconfig=kube_cluster.kubeconfig,
        )  # fmt: skip
        yield install
    finally:
        pods = kube_cluster.kubectl(
            "get", "pods", "-n", install.namespace, "-o", "name", check=False
        ).stdout.split()
        for pod in pods:
            print(
                f"--- operator log {pod} ---\n{node_agent.logs(install.namespace, pod.split('/')[-1], 'operator')[-4000:]}"
            )
        helm(
            "uninstall",
            install.release,
            "--namespace",
            install.namespace,
            "--wait",
            check=False,
            kubeconfig=kube_cluster.kubeconfig,
        )
        node_agent.unregister_image(OPERATOR_IMAGE)
        for ns in (install.jobs_namespace, install.namespace):
            kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def extraction_job(name: str, namespace: str, run_id: str = "r1", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "hsx.dev/v1alpha1",
        "kind": "ExtractionJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "runId": run_id,
            "model": {
                "path": "/models/tiny",
                "source": {"hostPath": {"path": MODEL_HOST_PATH}},
            },
            "server": {"gpus": 1},
            "dataset": {"uri": "/models/tiny/data.jsonl"},
            "output": {"uri": "s3://hsx-install-test/out"},
            **spec,
        },
    }


def apply(kube_cluster: Any, doc: dict[str, Any]) -> str:
    return str(kube_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc)).stdout)


def get(kube_cluster: Any, namespace: str, *what: str) -> Any:
    out = kube_cluster.kubectl("get", "-n", namespace, *what, "-o", "json", "--show-managed-fields").stdout
    return json.loads(out)


def jobs_of(kube_cluster: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    return list(get(kube_cluster, namespace, "jobs", "-l", f"{LABEL_XJ}={name}")["items"])


def settled(kube_cluster: Any, namespace: str, name: str, phase: str) -> dict[str, Any]:
    """The ExtractionJob once its status describes the current generation in `phase` and stops changing."""

    def current() -> dict[str, Any] | None:
        xj = get(kube_cluster, namespace, "extractionjob", name)
        status = xj.get("status", {})
        ok = status.get("phase") == phase and status.get("observedGeneration") == xj["metadata"]["generation"]
        return xj if ok else None

    first = wait_for(f"{name} in phase {phase}", current)
    while True:
        time.sleep(QUIET_SECONDS)
        again = wait_for(f"{name} in phase {phase}", current)
        if again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]:
            return dict(again)
        first = again  # still being written; a status that never settles fails by the timeout of the test


def test_operator_from_the_chart_reconciles_an_extraction_job(kube_cluster: Any, installed: Install) -> None:
    ns = installed.jobs_namespace
    apply(kube_cluster, extraction_job("first", ns))
    (job,) = wait_for("the run's Job", lambda: jobs_of(kube_cluster, ns, "first"))
    xj = get(kube_cluster, ns, "extractionjob", "first")
    assert job["metadata"]["ownerReferences"][0]["uid"] == xj["metadata"]["uid"]
    # Its pod runs on the test node, where the server image is unknown: the status names the reason.
    status = wait_for(
        "a reason in status",
        lambda: (s := get(kube_cluster, ns, "extractionjob", "first").get("status", {})).get("reason") and s,
    )
    assert status["phase"] in {"Pending", "Starting"}
    assert status["jobName"] == job["metadata"]["name"]
    assert run_health(get(kube_cluster, ns, "extractionjob", "first"))["status"] == "Progressing"


def test_the_charts_policy_refuses_host_paths_it_does_not_list(kube_cluster: Any, installed: Install) -> None:
    ns = installed.jobs_namespace
    model = {"path": "/models/tiny", "source": {"hostPath": {"path": "/var/lib/kubelet"}}}
    apply(kube_cluster, extraction_job("nodefs", ns, model=model))
    status = settled(kube_cluster, ns, "nodefs", "Failed")["status"]
    assert status["reason"] == "NotPermitted", status
    assert f"host path /var/lib/kubelet, which the operator does not allow (allowed prefixes: {MODEL_HOST_PATH})" in (
        status["message"]
    )
    assert jobs_of(kube_cluster, ns, "nodefs") == []


def test_the_operator_has_no_rights_outside_its_namespaces(kube_cluster: Any, installed: Install) -> None:
    sa = f"system:serviceaccount:{installed.namespace}:{installed.release}"
    for verb, resource, namespace, expected in [
        ("create", "jobs.batch", installed.jobs_namespace, "yes"),
        ("patch", "extractionjobs.hsx.dev/status", installed.jobs_namespace, "yes"),
        ("create", "jobs.batch", "default", "no"),
        ("list", "secrets", installed.jobs_namespace, "no"),
        ("update", "extractionjobs.hsx.dev", installed.jobs_namespace, "no"),
    ]:
        result = kube_cluster.kubectl(
            "auth", "can-i", verb, resource, "-n", namespace, "--as", sa, check=False
        )
        assert result.stdout.strip() == expected, (verb, resource, namespace, result.stdout, result.stderr)


def spec_managers(xj: dict[str, Any]) -> set[str]:
    return {
        m["manager"] for m in xj["metadata"].get("managedFields", []) if "f:spec" in m.get("fieldsV1", {})
    }


def test_unchanged_apply_changes_nothing_and_the_operator_never_writes_spec(
    kube_cluster: Any, installed: Install
) -> None:
    ns = installed.jobs_namespace
    doc = extraction_job("steady", ns, suspend=True)
    apply(kube_cluster, doc)
    before = settled(kube_cluster, ns, "steady", "Suspended")
    (job,) = jobs_of(kube_cluster, ns, "steady")
    assert "unchanged" in apply(kube_cluster, doc)  # what a GitOps sync of an unchanged manifest does
    time.sleep(QUIET_SECONDS)
    after = get(kube_cluster, ns, "extractionjob", "steady")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"] == before["spec"]
    assert [j["metadata"]["uid"] for j in jobs_of(kube_cluster, ns, "steady")] == [job["metadata"]["uid"]]
    # Only the applier owns spec fields: nothing the operator does shows up as drift from Git.
    assert spec_managers(after) == {"kubectl-client-side-apply"}, after["metadata"].get("managedFields")
    assert run_health(after)["status"] == "Suspended"


def test_a_new_run_id_starts_a_new_run(kube_cluster: Any, installed: Install) -> None:
    ns = installed.jobs_namespace
    apply(kube_cluster, extraction_job("rerun", ns, run_id="r1", suspend=True))
    first = settled(kube_cluster, ns, "rerun", "Suspended")
    (old_job,) = jobs_of(kube_cluster, ns, "rerun")
    apply(kube_cluster, extraction_job("rerun", ns, run_id="r2", suspend=True))
    second = settled(kube_cluster, ns, "rerun", "Suspended")
    assert second["metadata"]["generation"] == first["metadata"]["generation"] + 1
    assert second["status"]["observedRunId"] == "r2"
    jobs = wait_for(
        "only the new run's Job",
        lambda: (
            [
                j
                for j in jobs_of(kube_cluster, ns, "rerun")
                if j["metadata"]["uid"] != old_job["metadata"]["uid"]
            ]
            and jobs_of(kube_cluster, ns, "rerun")
        ),
    )
    (new_job,) = jobs
    assert new_job["metadata"]["name"] != old_job["metadata"]["name"]
    assert new_job["metadata"]["labels"]["hsx.dev/run-id"] == "r2"
    assert [h["runId"] for h in second["status"]["history"]] == ["r1"]
    assert spec_managers(second) == {"kubectl-client-side-apply"}


def test_ttl_cleanup_of_a_finished_run_does_not_start_it_again(kube_cluster: Any, installed: Install) -> None:
    ns = installed.jobs_namespace
    # The pod can never start on the test node (unknown image), so the deadline ends the run: Failed.
    doc = extraction_job("ttl", ns, activeDeadlineSeconds=3, ttlSecondsAfterFinished=0)
    apply(kube_cluster, doc)
    (job,) = wait_for("the run's Job", lambda: jobs_of(kube_cluster, ns, "ttl"))
    wait_for(
        "the TTL controller to delete the finished Job",
        lambda: not jobs_of(kube_cluster, ns, "ttl"),
        timeout_s=180,
    )
    final = settled(kube_cluster, ns, "ttl", "Failed")
    assert not jobs_of(kube_cluster, ns, "ttl"), "the operator re-created the run's Job after TTL cleanup"
    assert final["status"]["jobName"] == job["metadata"]["name"]
    assert run_health(final)["status"] == "Degraded"
    # A later unchanged sync still changes nothing.
    assert "unchanged" in apply(kube_cluster, doc)
    time.sleep(QUIET_SECONDS)
    assert not jobs_of(kube_cluster, ns, "ttl")
    assert (
        get(kube_cluster, ns, "extractionjob", "ttl")["metadata"]["resourceVersion"]
        == final["metadata"]["resourceVersion"]
    )


def selftest_log(node_agent: Any, installed: Install) -> str:
    """What helm test's pod printed, in all its runs (the node keeps it after a passed test deletes the pod)."""
    return str(node_agent.logs(installed.namespace, f"{installed.release}-selftest", "selftest"))


def test_helm_test_proves_the_install_and_fails_without_an_operator(
    kube_cluster: Any, node_agent: Any, installed: Install
) -> None:
    """Last in this module: it stops the operator for a while."""
    ns = installed.jobs_namespace
    passed = helm("test", installed.release, "--namespace", installed.namespace, "--timeout", "180s",
                  kubeconfig=kube_cluster.kubeconfig, check=False)  # fmt: skip
    assert passed.returncode == 0, passed.stdout + passed.stderr + selftest_log(node_agent, installed)
    assert "Succeeded" in passed.stdout, passed.stdout
    assert "the install works" in selftest_log(node_agent, installed)
    xjs = get(kube_cluster, ns, "extractionjobs")["items"]
    assert not [x for x in xjs if x["metadata"]["name"].startswith("hsx-selftest-")], "selftest left its run"
    assert not [j for j in get(kube_cluster, ns, "jobs")["items"] if "selftest" in j["metadata"]["name"]]

    # Without an operator the same test fails, saying so (the check can fail).
    deployment = f"deployment/{installed.release}"
    kube_cluster.kubectl("scale", deployment, "-n", installed.namespace, "--replicas=0")
    try:
        wait_for(
            "the operator's pod to go",
            lambda: not [
                p
                for p in get(kube_cluster, installed.namespace, "pods")["items"]
                if not p["metadata"]["name"].endswith("-selftest")
            ],
        )
        failed = helm("test", installed.release, "--namespace", installed.namespace, "--timeout", "180s",
                      kubeconfig=kube_cluster.kubeconfig, check=False)  # fmt: skip
        assert failed.returncode != 0, failed.stdout
        assert "no operator wrote the status" in selftest_log(node_agent, installed)
    finally:
        kube_cluster.kubectl("scale", deployment, "-n", installed.namespace, "--replicas=1")
        kube_cluster.kubectl(
            "rollout", "status", deployment, "-n", installed.namespace, "--timeout=180s", check=False
        )
