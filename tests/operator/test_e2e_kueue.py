"""hsx under Kueue's real controller (v0.17, built from its Go module, tests/ground/kueue.py): a queued run is
admitted by a ClusterQueue with one GPU of quota, preempted by a higher-priority run (Kueue suspends its Job;
the ExtractionJob says Queued in Kueue's own words and keeps its committed shards), and resumed by Kueue once
the quota is free, ending with every row stored exactly once."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_operator.desired import EXTRACTOR_UID
from tests.ground.kueue import kueue_installed
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import (
    SLOW,
    committed_files,
    phase,
    planned_shards,
    reason_is,
    run_store,
    start_slow_run,
    verify,
)
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FLAVOR, CLUSTER_QUEUE, QUEUE = "hsx-test-flavor", "hsx-test-cq", "team-a"
PRIORITIES = {"hsx-test-low": 100, "hsx-test-high": 1000}


def quota_objects(namespace: str, gpus: int = 1) -> list[dict[str, Any]]:
    """``gpus`` GPUs of quota; within the ClusterQueue a higher-priority Workload preempts a lower one."""
    resources = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": str(gpus), "ephemeral-storage": "1Ti"}
    return [
        *(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": name},
                "value": value,
            }
            for name, value in PRIORITIES.items()
        ),
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": CLUSTER_QUEUE},
            "spec": {
                "namespaceSelector": {},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": list(resources),
                        "flavors": [
                            {
                                "name": FLAVOR,
                                "resources": [{"name": k, "nominalQuota": v} for k, v in resources.items()],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": namespace},
            "spec": {"clusterQueue": CLUSTER_QUEUE},
        },
    ]


@contextlib.contextmanager
def kueue_with_quota(
    ns: Namespace, node_agent: Any, *, gpus: int = 1, frameworks: tuple[str, ...] = ("batch/job",)
) -> Iterator[None]:
    """Kueue running with the test's queues and quota (quota_objects) for the kinds in `frameworks`."""
    # JobSets before Jobs: a JobSet would recreate a Job deleted under it.
    owners = {"jobset.x-k8s.io/jobset": "jobsets.jobset.x-k8s.io", "batch/job": "jobs"}
    with kueue_installed(ns.cluster, node_agent, frameworks=frameworks):
        objects = quota_objects(ns.name, gpus=gpus)
        ns.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
        try:
            yield
        finally:
            # While Kueue runs, so that it lifts its finalizers: the workloads' owners, the Workloads, the queues.
            for owner in [kind for framework, kind in owners.items() if framework in frameworks]:
                ns.kubectl("delete", owner, "--all", "--wait=true", "--timeout=60s", check=False)
            ns.kubectl("delete", "workloads.kueue.x-k8s.io", "--all", "--wait=true", "--timeout=60s", check=False)
            ns.cluster.kubectl(
                "delete", "-f", "-", "--ignore-not-found", "--wait=true", "--timeout=60s",
                input=yaml.safe_dump_all(objects), check=False,
            )  # fmt: skip


@pytest.fixture
def kueue(ns: Namespace, node_agent: Any) -> Iterator[None]:
    with kueue_with_quota(ns, node_agent):
        yield


def own_output(run_env: dict[str, Any], name: str) -> dict[str, Any]:
    out: Path = run_env["output"] / name
    out.mkdir(parents=True, exist_ok=True)
    os.chown(out, EXTRACTOR_UID, EXTRACTOR_UID)
    return {**run_env, "output": out}


def test_kueue_admits_preempts_and_resumes_a_run(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    kueue: None,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    start_operator()
    low_env = own_output({**run_env, "dataset": long_dataset}, "low")
    # Admitted by Kueue (the operator only creates the Job suspended): Running, a shard committed.
    run_dir = start_slow_run(
        ns,
        "low",
        low_env,
        server={**SLOW["server"], "gpus": 1},
        scheduling={"queueName": QUEUE, "priorityClassName": "hsx-test-low"},
    )
    job = ns.get("job", "low-r1")
    assert job is not None and job["spec"]["suspend"] is False

    # A higher-priority run needs the only GPU: Kueue evicts the low one and suspends its Job.
    high_env = own_output(run_env, "high")
    ns.apply(
        xj_manifest(
            "high",
            "r1",
            **high_env,
            server={"gpus": 1},
            scheduling={"queueName": QUEUE, "priorityClassName": "hsx-test-high"},
        )
    )
    held = wait_for(reason_is(ns, "low", "Queued"), 120, "the low run to be preempted and Queued")
    assert held["phase"] == "Suspended", held
    assert "Kueue holds Job low-r1 in queue team-a; Workload job-low-r1-" in held["message"], held
    assert "evicted: Preempted to accommodate a workload" in held["message"], held
    low_job = ns.get("job", "low-r1")
    assert low_job is not None and low_job["spec"]["suspend"] is True
    wait_for(lambda: not ns.pods_of("low-r1"), 120, "the preempted run's pods to be deleted")
    kept = committed_files(run_dir, "r1")
    assert kept, "no committed shard kept across the preemption"

    high = wait_for(phase(ns, "high", "Succeeded", "Failed"), 300, "the high-priority run to end")
    assert high["phase"] == "Succeeded", high

    # The quota is free again: Kueue readmits the low run, which resumes from its committed shards.
    done = wait_for(phase(ns, "low", "Succeeded", "Failed"), 420, "the preempted run to end")
    assert done["phase"] == "Succeeded", done
    after = committed_files(run_dir, "r1")
    assert {k: after.get(k) for k in kept} == kept  # the same files: resumed, not redone
    total = planned_shards(run_dir)
    assert run_store(low_env["output"], "r1").committed_shards() == set(range(total))
    report = verify(run_dir)
    assert report["ok"] and report["duplicates"] == 0, report
    rows = len(long_dataset.read_bytes().splitlines())
    assert report["samples"] + report["quarantined"] == rows, report
