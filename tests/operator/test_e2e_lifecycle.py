"""Run lifecycle and GitOps reruns on the real control plane and node agent, with the real extractor and
the CPU reference server: suspend/resume, a runId bump after success, an unchanged re-apply, deleting a
run mid-way, and a run whose output is the real S3 server over HTTPS with a private CA.

A spec change other than runId/suspend is refused by the CRD's CEL rule whatever the run's state
(CEL cannot see status), which tests/operator/test_crd_cluster.py::test_spec_is_locked_while_runid_stays
covers on the real API server; it needs no operator, so there is no e2e case for it here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ground.pki import CertificateAuthority
from tests.operator.conftest import HSX, OperatorProcess, wait_for
from tests.operator.e2e import (
    QUIET_SECONDS,
    committed_files,
    conditions,
    file_digests,
    final_log,
    patch_spec,
    phase,
    planned_shards,
    progressed,
    run_store,
    settled,
    start_slow_run,
    status_patches,
    verify,
)
from tests.operator.kube_helpers import Namespace, xj_manifest
from tests.storage.faultproxy import FaultPlan, FaultProxy, serving_context

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_suspend_deletes_the_pod_keeps_shards_and_resume_continues_from_them(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    start_operator()
    env = {**run_env, "dataset": long_dataset}
    run_dir = start_slow_run(ns, "pause", env)
    first_pods = {p["metadata"]["name"] for p in ns.pods_of("pause-r1")}

    patch_spec(ns, "pause", {"suspend": True})
    wait_for(lambda: not ns.pods_of("pause-r1"), 120, "the Job's pods to be deleted")
    suspended = wait_for(phase(ns, "pause", "Suspended"), 60, "phase Suspended")
    assert conditions(suspended)["Suspended"] == "True", suspended
    assert suspended["reason"] == "Suspended", suspended
    job = ns.get("job", "pause-r1")
    assert job is not None and job["spec"]["suspend"] is True
    kept = committed_files(run_dir, "r1")
    kept_shards = run_store(env["output"], "r1").committed_shards()
    assert kept and kept_shards, "no committed shard to resume from"
    total_shards = planned_shards(run_dir)
    assert len(kept_shards) < total_shards, (kept_shards, total_shards)
    # Nothing runs while suspended: the pods stay gone over several polls.
    time.sleep(QUIET_SECONDS)
    assert not ns.pods_of("pause-r1")
    assert ns.status("pause")["phase"] == "Suspended"

    patch_spec(ns, "pause", {"suspend": False})
    done = wait_for(phase(ns, "pause", "Succeeded", "Failed"), 420, "the resumed run to end")
    assert done["phase"] == "Succeeded", done
    assert "Resumed" in ns.event_reasons("pause") and "Suspended" in ns.event_reasons("pause")
    (second,) = [
        p["metadata"]["name"] for p in ns.pods_of("pause-r1") if p["metadata"]["name"] not in first_pods
    ]

    # Resumed, not restarted: the shards committed before the suspension are the same files, and the new
    # pod extracted exactly the tokens of the shards that were not committed yet.
    after = committed_files(run_dir, "r1")
    assert {k: after.get(k) for k in kept} == kept
    store = run_store(env["output"], "r1")
    assert store.committed_shards() == set(range(total_shards))
    tokens_of = {k: sum(s.seq_len for s in store.read_header(k).samples) for k in range(total_shards)}
    samples_done, samples_total, tokens_done = final_log(hsx_node, ns.name, second)
    assert samples_done == samples_total > 0
    assert tokens_done == sum(t for k, t in tokens_of.items() if k not in kept_shards), (
        tokens_done,
        tokens_of,
    )
    assert tokens_done < sum(tokens_of.values())

    report = verify(run_dir)
    assert report["ok"] and report["duplicates"] == 0, report
    assert report["shardsCommitted"] == total_shards and report["manifest"], report
    rows = len(long_dataset.read_bytes().splitlines())
    assert report["samples"] + report["quarantined"] == rows, report  # each row once: stored or quarantined


def test_new_run_id_after_success_runs_again_and_keeps_the_first_run_byte_for_byte(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    start_operator()
    ns.apply(xj_manifest("again", "r1", **run_env))
    first = wait_for(phase(ns, "again", "Succeeded", "Failed"), 300, "run r1 to end")
    assert first["phase"] == "Succeeded", first
    r1 = run_env["output"] / "r1"
    before = file_digests(r1)
    assert any(k.startswith("shards/") for k in before), before
    first_job = ns.get("job", "again-r1")
    assert first_job is not None

    ns.apply(xj_manifest("again", "r2", **run_env))
    second_job = wait_for(lambda: ns.get("job", "again-r2"), 60, "run r2's Job")
    assert second_job["metadata"]["uid"] != first_job["metadata"]["uid"]
    assert second_job["metadata"]["labels"]["hsx.dev/run-id"] == "r2"
    second = wait_for(
        lambda: (
            (st := ns.status("again")).get("observedRunId") == "r2"
            and st.get("phase") in ("Succeeded", "Failed")
            and st
        ),
        300,
        "run r2 to end",
    )
    assert second["phase"] == "Succeeded", second
    assert second["jobName"] == "again-r2"
    assert second["output"]["prefix"] == f"{run_env['output']}/r2/"
    assert [(h["runId"], h["phase"]) for h in second["history"]] == [("r1", "Succeeded")], second["history"]
    assert verify(run_env["output"] / "r2")["ok"]

    # The first run: its finished Job kept as it was, its output untouched and still valid.
    kept_job = ns.get("job", "again-r1")
    assert kept_job is not None and kept_job["metadata"]["uid"] == first_job["metadata"]["uid"]
    assert file_digests(r1) == before
    assert verify(r1)["ok"]
    assert {j["metadata"]["name"] for j in ns.items("jobs")} == {"again-r1", "again-r2"}


def test_reapplying_a_succeeded_run_changes_nothing(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    start_operator()
    manifest = xj_manifest("steady", "r1", **run_env)
    ns.apply(manifest)
    done = wait_for(phase(ns, "steady", "Succeeded", "Failed"), 300, "the run to end")
    assert done["phase"] == "Succeeded", done
    before = settled(ns, "steady")
    job = ns.get("job", "steady-r1")
    assert job is not None
    output = file_digests(run_env["output"] / "r1")

    assert "unchanged" in ns.apply(manifest)  # a GitOps sync of the same manifest
    # A settled object is written no more (issue 38: a null in status was re-patched every poll):
    # 30 s is 30 of the test operator's 1 s polls, more than a minute of the default 5 s.
    patches = status_patches(ns)
    time.sleep(max(QUIET_SECONDS, 30))
    assert status_patches(ns) == patches
    after = ns.get("xj", "steady")
    assert after is not None
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["status"] == before["status"]
    jobs = ns.items("jobs")
    assert [(j["metadata"]["uid"], j["metadata"]["resourceVersion"]) for j in jobs] == [
        (job["metadata"]["uid"], job["metadata"]["resourceVersion"])
    ]
    assert file_digests(run_env["output"] / "r1") == output


def test_deleting_a_running_job_removes_its_objects_and_keeps_its_data(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    start_operator: Callable[[], OperatorProcess],
) -> None:
    start_operator()
    env = {**run_env, "dataset": long_dataset}
    run_dir = start_slow_run(ns, "gone", env)
    xj = ns.get("xj", "gone")
    assert xj is not None and "hsx.dev/finalizer" in xj["metadata"]["finalizers"]
    assert ns.get("configmap", "gone-r1-config") is not None
    kept = committed_files(run_dir, "r1")

    ns.kubectl("delete", "xj", "gone", "--wait=false")
    wait_for(lambda: ns.get("xj", "gone") is None, 180, "the ExtractionJob to be gone (finalizer released)")
    assert ns.get("job", "gone-r1") is None  # the finalizer waited for the Job
    wait_for(lambda: not ns.pods_of("gone-r1"), 120, "the pods to be gone")
    wait_for(
        lambda: ns.get("configmap", "gone-r1-config") is None, 120, "the ConfigMap to be garbage-collected"
    )

    # Data is never deleted: every shard committed before the delete is still there, byte for byte.
    after = committed_files(run_dir, "r1")
    assert {k: after.get(k) for k in kept} == kept
    store = run_store(env["output"], "r1")
    for k in store.committed_shards():
        assert store.read_header(k).samples, k
    assert planned_shards(run_dir) > len(store.committed_shards()), "the run was not cut short"


@pytest.fixture
def onprem_s3(s3_server: Any, hsx_node: Any, tmp_path: Path) -> Iterator[tuple[FaultProxy, Path]]:
    """An on-prem store: HTTPS with a certificate of the cluster's own CA (the CA's PEM beside it); the proxy
    terminates TLS in front of the real S3 server."""
    ca = CertificateAuthority("hsx-onprem-s3-ca")
    serving = ca.issue("s3.onprem", ip_addresses=[hsx_node.net.gateway, "127.0.0.1"], server=True)
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    tls = serving_context(serving.cert_pem, serving.key_pem, tmp_path)
    with FaultProxy(s3_server.endpoint, FaultPlan(seed=0, rate=0.0), tls) as proxy:
        yield proxy, tmp_path / "ca.crt"


def test_run_with_s3_over_https_signed_by_a_private_ca_and_a_credentials_secret(
    ns: Namespace,
    run_env: dict[str, Any],
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
    s3_server: Any,
    s3_bucket: str,
    onprem_s3: tuple[FaultProxy, Path],
) -> None:
    # The pods learn the store's CA only from a ConfigMap (spec.pod.caBundleConfigMap).
    proxy, ca_file = onprem_s3
    ns.kubectl("create", "configmap", "s3-ca", f"--from-file=ca.crt={ca_file}")
    port = int(proxy.endpoint.rsplit(":", 1)[1])
    pod_endpoint = f"https://{hsx_node.forward_host_port(port)}"  # pods have their own network namespace
    ns.kubectl(
        "create", "secret", "generic", "s3-creds",
        f"--from-literal=AWS_ACCESS_KEY_ID={s3_server.access_key}",
        f"--from-literal=AWS_SECRET_ACCESS_KEY={s3_server.secret_key}",
    )  # fmt: skip
    start_operator()
    output = {
        "uri": f"s3://{s3_bucket}/runs",
        "endpoint": pod_endpoint,
        "region": s3_server.region,
        "pathStyle": True,
        "credentialsSecret": "s3-creds",
        "shardTargetBytes": 1 << 20,
    }
    manifest = xj_manifest("s3", "r1", **run_env, pod={"caBundleConfigMap": "s3-ca"})
    manifest["spec"]["output"] = output
    ns.apply(manifest)
    moving = wait_for(progressed(ns, "s3"), 240, "progress")
    assert moving["phase"] != "Failed", moving
    done = wait_for(phase(ns, "s3", "Succeeded", "Failed"), 300, "the run to end")
    assert done["phase"] == "Succeeded", done
    assert proxy.counts["requests"] > 0  # the pods wrote through TLS, trusting the ConfigMap's CA
    assert done["output"]["prefix"] == f"s3://{s3_bucket}/runs/r1/"
    env_names = {
        e["name"]
        for e in (ns.get("job", "s3-r1") or {})["spec"]["template"]["spec"]["containers"][0].get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= env_names

    # The shards are in the bucket, and the CLI verifies them there (endpoint and keys from the environment).
    keys = [
        o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="runs/r1/")["Contents"]
    ]
    assert any("/shards/" in k for k in keys) and "runs/r1/manifest.json" in keys, keys
    done_verify = subprocess.run(
        [HSX, "verify", "--json", f"s3://{s3_bucket}/runs/r1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **s3_server.env()},
    )
    assert done_verify.returncode == 0, done_verify.stdout + done_verify.stderr
    report = json.loads(done_verify.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["manifest"] and report["duplicates"] == 0, report
    rows = len(run_env["dataset"].read_bytes().splitlines())
    assert report["samples"] > 0 and report["samples"] + report["quarantined"] == rows, report
