"""Runs that cannot start, on the real control plane and node agent (issue 18, item 1): a Job the API
server rejects fails the run at once with the API server's words, pods the Job controller may not
create (ResourceQuota) and a container whose Secret is missing stall the run with the real message,
and nothing is retried behind a blank status."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import QUIET_SECONDS, conditions, phase, reason_is
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def xj_events(ns: Namespace, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in ns.items("events")
        if e["involvedObject"].get("kind") == "ExtractionJob" and e["involvedObject"].get("name") == name
    ]


def test_a_job_the_api_server_rejects_fails_the_run_with_its_message(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    op = start_operator()
    # Both pass the CRD (it does not repeat the Pod API's validation); the Job API refuses them.
    ns.apply(xj_manifest("badsel", "r1", **run_env, scheduling={"nodeSelector": {"gpu type!": "h100"}}))
    ns.apply(
        xj_manifest(
            "badtol",
            "r1",
            **run_env,
            scheduling={"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]},
        )
    )
    # The Kubernetes client refuses this one itself, before any request (its models are pydantic):
    # once a blank status retried every 60 s (issue 38).
    ns.apply(xj_manifest("badaff", "r1", **run_env, scheduling={"affinity": {"nodeAffinity": "yes please"}}))
    for name, words in (
        ("badsel", "nodeSelector"),
        ("badtol", "tolerations[0]"),
        ("badaff", "affinity.nodeAffinity: Input should be a valid dictionary"),
    ):
        failed = wait_for(phase(ns, name, "Failed"), 60, f"{name} to fail")
        assert failed["reason"] == "InvalidJobSpec", failed
        said = f'Job.batch "{name}-r1" is invalid' if name != "badaff" else f"Job {name}-r1 is invalid"
        assert said in failed["message"] and words in failed["message"], failed
        assert "change runId" in failed["message"]
        assert conditions(failed)["Failed"] == "True" and conditions(failed)["Stalled"] == "True"
        warnings = [
            e for e in xj_events(ns, name) if e["type"] == "Warning" and e["reason"] == "InvalidJobSpec"
        ]
        assert warnings and words in warnings[0]["message"], xj_events(ns, name)
        assert warnings[0]["source"].get("component") == "hsx-operator", warnings[0]
    # A trigger that raced the first status write may have tried once more; after that, no retries.
    creates_logged = op.tail(400).count("creating Job badsel-r1")
    time.sleep(QUIET_SECONDS)  # several operator polls: no further attempt, the status stands
    assert op.tail(400).count("creating Job badsel-r1") == creates_logged <= 2, op.tail()
    assert not any(ns.get("job", f"{n}-r1") for n in ("badsel", "badtol", "badaff"))
    assert "from spec.scheduling.affinity" in ns.status("badaff")["message"]
    # Log lines name the object they are about.
    assert "badaff runId=r1: creating Job badaff-r1" in op.tail(400), op.tail()
    assert ns.status("badsel")["reason"] == "InvalidJobSpec"


def test_quota_and_a_missing_secret_stall_the_run_with_the_real_message(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    start_operator()
    # No pod may be created in the namespace: the Job controller's creates are refused (FailedCreate).
    ns.forbid_pods()
    ns.apply(xj_manifest("quota", "r1", **run_env))
    stalled = wait_for(reason_is(ns, "quota", "FailedCreate"), 120, "reason FailedCreate")
    assert stalled["phase"] == "Pending", stalled
    assert "exceeded quota: no-pods" in stalled["message"] and "Job quota-r1" in stalled["message"], stalled
    assert conditions(stalled)["Stalled"] == "True"
    assert "FailedCreate" in [e["reason"] for e in xj_events(ns, "quota") if e["type"] == "Warning"]

    ns.kubectl("delete", "resourcequota", "no-pods")
    secretless = xj_manifest("nosecret", "r1", **run_env)
    secretless["spec"]["output"]["credentialsSecret"] = "absent-creds"
    ns.apply(secretless)
    missing = wait_for(
        reason_is(ns, "nosecret", "CreateContainerConfigError"), 180, "CreateContainerConfigError"
    )
    assert missing["phase"] in ("Pending", "Starting") and "absent-creds" in missing["message"], missing
    assert conditions(missing)["Stalled"] == "True"


WORKLOAD_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "workloads.kueue.x-k8s.io"},
    "spec": {
        "group": "kueue.x-k8s.io",
        "scope": "Namespaced",
        "names": {
            "kind": "Workload",
            "plural": "workloads",
            "singular": "workload",
            "listKind": "WorkloadList",
        },
        "versions": [
            {
                "name": "v1beta2",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def test_queued_only_when_kueue_holds_the_job(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    """Without Kueue a queueName run says Kueue is missing; with Kueue's API (here only its Workload
    CRD, standing in for its controller) and a Workload for the Job, it is Queued with Kueue's words."""
    start_operator()
    ns.apply(xj_manifest("queued", "r1", **run_env, scheduling={"queueName": "team-a"}))
    missing = wait_for(reason_is(ns, "queued", "KueueNotInstalled"), 60, "KueueNotInstalled")
    assert missing["phase"] == "Suspended" and "install Kueue" in missing["message"], missing
    assert conditions(missing)["Stalled"] == "True"
    job = ns.get("job", "queued-r1")
    assert job is not None and job["spec"]["suspend"] is True and not ns.pods_of("queued-r1")

    crd = json.dumps(WORKLOAD_CRD)
    ns.cluster.kubectl("apply", "-f", "-", input=crd)
    try:
        ns.cluster.wait_crd_established("workloads.kueue.x-k8s.io")
        wait_for(reason_is(ns, "queued", "WaitingForWorkload"), 60, "WaitingForWorkload")
        message = "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu"
        ns.apply(
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "Workload",
                "metadata": {
                    "name": "job-queued-r1-abcde",
                    "labels": {"kueue.x-k8s.io/job-uid": job["metadata"]["uid"]},
                },
                "spec": {"queueName": "team-a"},
                "status": {
                    "conditions": [
                        {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message}
                    ]
                },
            }
        )
        queued = wait_for(reason_is(ns, "queued", "Queued"), 60, "Queued")
        assert message in queued["message"] and "queue team-a" in queued["message"], queued
        assert queued["phase"] == "Suspended" and conditions(queued)["Stalled"] == "False"
    finally:
        ns.cluster.kubectl("delete", "crd", "workloads.kueue.x-k8s.io", "--ignore-not-found", "--wait=true")


def test_host_paths_and_system_priority_outside_the_admins_policy_fail_the_run(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    op = start_operator()  # allows host paths under the session's work directory only
    ns.apply(xj_manifest("nodefs", "r1", **{**run_env, "model_root": Path("/etc")}))
    ns.apply(xj_manifest("critical", "r1", **run_env, scheduling={"priorityClassName": "system-node-critical"}))
    for name, words in (
        ("nodefs", "spec.model.source.hostPath.path mounts host path /etc"),
        ("critical", "system-node-critical is reserved"),
    ):
        failed = wait_for(phase(ns, name, "Failed"), 60, f"{name} to fail")
        assert failed["reason"] == "NotPermitted", failed
        assert words in failed["message"] and "change runId" in failed["message"], failed
        assert ns.get("job", f"{name}-r1") is None
    # The same run with paths under the allowed prefix is created: the policy, not the spec, refused.
    ns.apply(xj_manifest("allowed", "r1", **run_env, suspend=True))
    wait_for(lambda: ns.get("job", "allowed-r1"), 60, "the allowed run's Job")
    wait_for(lambda: "hsx.dev/finalizer" in (ns.get("xj", "allowed") or {})["metadata"].get("finalizers", []),
             60, "the finalizer on a run that has a Job")  # fmt: skip
    ns.kubectl("delete", "xj", "allowed", "--timeout=60s")  # released by the operator
    # A run that never had a Job carries no finalizer: its delete waits on nothing, not even on the
    # operator (once one was held over 60 s under load, issue 38).
    wait_for(lambda: "hsx.dev/finalizer" not in (ns.get("xj", "nodefs") or {})["metadata"].get("finalizers", []),
             30, "no finalizer on a refused run")  # fmt: skip
    op.stop()
    ns.kubectl("delete", "xj", "nodefs", "critical", "--timeout=20s")
    assert ns.get("xj", "nodefs") is None and ns.get("xj", "critical") is None


def test_a_missing_dataset_fails_in_preflight_before_the_server_starts(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess], hsx_node: Any
) -> None:
    start_operator()
    missing = run_env["dataset"].parent / "no-such-chat.jsonl"
    ns.apply(xj_manifest("nodata", "r1", **{**run_env, "dataset": missing}))
    failed = wait_for(phase(ns, "nodata", "Failed"), 120, "the run to fail in preflight")
    assert failed["reason"] == "PreflightFailed", failed
    assert "preflight exited 3 (permanent failure)" in failed["message"] and str(missing) in failed["message"]
    (pod,) = ns.items("pods")
    statuses = {c["name"]: c for c in pod["status"]["initContainerStatuses"]}
    assert statuses["preflight"]["state"]["terminated"]["exitCode"] == 3
    # The server (weights, GPUs) never started: the preflight stopped the pod first.
    assert not {"running", "terminated"} & set(statuses["sglang"]["state"]), statuses["sglang"]
    assert hsx_node.logs(ns.name, pod["metadata"]["name"], "sglang") == ""


def test_an_output_directory_the_extractor_cannot_write_fails_in_preflight(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    # What the kubelet makes for a missing hostPath (DirectoryOrCreate): root's, 0755. The extractor
    # runs as uid 65532 without capabilities (the node agent honours the pod's securityContext).
    start_operator()
    root_owned = run_env["output"].parent / f"{ns.name}-root-owned"
    ns.apply(xj_manifest("rootout", "r1", **{**run_env, "output": root_owned}))
    failed = wait_for(phase(ns, "rootout", "Failed"), 120, "the run to fail in preflight")
    assert failed["reason"] == "PreflightFailed", failed
    assert f"output directory {root_owned}/r1 is not writable by this process (uid 65532" in failed["message"]
    assert "install -d -o 65532 -g 65532 DIR" in failed["message"], failed["message"]
    assert root_owned.stat().st_uid == 0 and not (root_owned / "r1").exists()


def test_a_hundred_character_name_reconciles_and_deletes(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    """Issue 18 item 2: the name is hashed into label values and the Job's name; deletion is not stuck."""
    start_operator()
    name = "n" * 100
    ns.apply(xj_manifest(name, "r1", **run_env, suspend=True))
    suspended = wait_for(phase(ns, name, "Suspended"), 60, "the long-named run to be suspended")
    job = ns.get("job", suspended["jobName"])
    assert job is not None and len(suspended["jobName"]) <= 60
    assert len(job["metadata"]["labels"]["hsx.dev/extractionjob"]) <= 63
    ns.kubectl("delete", "xj", name, "--wait=true", "--timeout=60s")
    wait_for(lambda: ns.get("job", suspended["jobName"]) is None or None, 60, "the Job to be gone")
