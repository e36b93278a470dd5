"""Runs that go wrong, on the real control plane and node agent with the real extractor and the CPU
reference server: stuck pods say why, a permanent failure is not retried, a dead server or extractor
is recovered from without losing or repeating a sample, a killed operator (and a second one) neither
duplicates the Job nor loses status, and two replicas split the shards under one status.

Active deadlines and TTL cleanup of a failed run are covered with the chart's operator in
tests/install/test_chart_cluster.py.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.faults.helpers import committed_by
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import (
    QUIET_SECONDS,
    SLOW,
    committed_files,
    conditions,
    final_log,
    phase,
    planned_shards,
    progressed,
    reason_is,
    run_store,
    start_slow_run,
    verify,
)
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

WRONG_FINGERPRINT = "0" * 64


def rows_of(dataset: Path) -> int:
    return len(dataset.read_bytes().splitlines())


def assert_each_row_once(run_dir: Path, dataset: Path) -> dict[str, Any]:
    report = verify(run_dir)
    assert report["ok"] and report["manifest"] and report["duplicates"] == 0, report
    assert report["samples"] + report["quarantined"] == rows_of(dataset), report
    return report


def test_stuck_runs_say_why_and_the_startup_deadline_ends_them(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    start_operator()
    # The test node has 8 GPUs: a 16-GPU pod is never scheduled.
    ns.apply(xj_manifest("nogpu", "r1", **run_env, server={"gpus": 16}))
    ns.apply(
        xj_manifest(
            "nopull",
            "r1",
            **run_env,
            server={"image": "registry.invalid/hsx-sglang:missing"},
            startupDeadlineSeconds=40,
        )
    )
    unschedulable = wait_for(reason_is(ns, "nogpu", "Unschedulable"), 120, "reason Unschedulable")
    assert unschedulable["phase"] == "Pending", unschedulable
    assert "nvidia.com/gpu" in unschedulable["message"], unschedulable  # the scheduler's own words
    assert conditions(unschedulable)["Stalled"] == "True"
    pulling = wait_for(
        reason_is(ns, "nopull", "ErrImagePull", "ImagePullBackOff"), 120, "an image pull reason"
    )
    assert "registry.invalid/hsx-sglang:missing" in pulling["message"], pulling
    assert conditions(pulling)["Stalled"] == "True"

    failed = wait_for(phase(ns, "nopull", "Failed"), 120, "the startup deadline")
    assert failed["reason"] == "StartupDeadlineExceeded", failed
    assert "startupDeadlineSeconds=40" in failed["message"] and "ImagePull" in failed["message"], failed
    assert conditions(failed)["Failed"] == "True"
    # The operator ended the Job: its pod goes, so no GPU stays held by a run that cannot start.
    wait_for(lambda: not ns.pods_of("nopull-r1"), 120, "the failed run's pods to be gone")
    assert "Unschedulable" in ns.event_reasons("nogpu")
    assert "StartupDeadlineExceeded" in ns.event_reasons("nopull")
    # Without a deadline the unschedulable run waits, still saying why.
    assert ns.status("nogpu")["reason"] == "Unschedulable"


def test_permanent_failure_fails_at_once_without_retries(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    start_operator()
    manifest = xj_manifest("wrongtok", "r1", **run_env, backoffLimit=3)
    manifest["spec"]["dataset"]["expectedTokenizerFingerprint"] = WRONG_FINGERPRINT
    ns.apply(manifest)
    failed = wait_for(phase(ns, "wrongtok", "Failed"), 240, "the run to fail")
    # The tokenizer check needs no server: the pod's preflight finds it before weights load.
    assert failed["reason"] == "PreflightFailed", failed
    assert "preflight exited 3 (permanent failure)" in failed["message"], failed
    assert "tokenizer fingerprint mismatch" in failed["message"] and WRONG_FINGERPRINT in failed["message"]
    assert failed["attempt"] == 1, failed
    assert len(ns.pods_of("wrongtok-r1")) == 1  # backoffLimit 3, yet no second pod
    job = ns.get("job", "wrongtok-r1")
    assert job is not None and job["status"].get("failed") == 1
    time.sleep(QUIET_SECONDS)
    assert len(ns.pods_of("wrongtok-r1")) == 1 and ns.status("wrongtok")["phase"] == "Failed"


def test_a_server_that_dies_before_ready_fails_the_run_at_once_with_its_exit_code_and_log(
    ns: Namespace, run_env: dict[str, Any], start_operator: Callable[[], OperatorProcess]
) -> None:
    start_operator()
    # Weights the preflight does not read: the tokenizer and config are fine, the server cannot load.
    broken = run_env["model_root"] / "broken-weights"
    if not broken.exists():
        shutil.copytree(run_env["model_root"] / "tiny", broken)
        (broken / "model.safetensors").write_bytes(b"\0" * 64)
    manifest = xj_manifest("deadserver", "r1", **run_env, backoffLimit=3)
    manifest["spec"]["model"]["path"] = "/models/broken-weights"
    ns.apply(manifest)
    failed = wait_for(phase(ns, "deadserver", "Failed"), 180, "the run to fail")
    assert failed["reason"] == "ServerExited", failed
    assert "exited with code 1 (Error) before it was ready" in failed["message"], failed
    assert "SafetensorError" in failed["message"], failed  # the tail of the server's own log
    assert conditions(failed)["Failed"] == "True" and "ServerExited" in ns.event_reasons("deadserver")
    # Not retried: no second pod loaded the weights, and the stopped Job's pod goes.
    assert len(ns.pods_of("deadserver-r1")) <= 1
    wait_for(lambda: not [p for p in ns.pods_of("deadserver-r1") if p["status"].get("phase") in ("Pending", "Running")],
             120, "the failed run's pod to stop")  # fmt: skip


def test_server_killed_mid_run_is_restarted_and_the_run_completes(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    start_operator()
    env = {**run_env, "dataset": long_dataset}
    run_dir = start_slow_run(ns, "srvdies", env)
    (pod,) = ns.pods_of("srvdies-r1")
    hsx_node.kill_container(ns.name, pod["metadata"]["name"], "sglang", signal.SIGKILL)

    done = wait_for(phase(ns, "srvdies", "Succeeded", "Failed"), 420, "the run to end")
    assert done["phase"] == "Succeeded", done
    pods = ns.pods_of("srvdies-r1")
    restarts = sum(
        s.get("restartCount", 0) for p in pods for s in p["status"].get("initContainerStatuses") or []
    )
    # The kubelet restarts the sidecar; if the extractor gave up first, the Job's retry took over.
    assert restarts >= 1 or done["attempt"] >= 2, [p["status"] for p in pods]
    # Requests in flight when it died were answered by nobody; each row still ends up exactly once.
    assert_each_row_once(run_dir, long_dataset)


def test_extractor_killed_mid_run_is_retried_and_resumes_from_committed_shards(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    start_operator()
    env = {**run_env, "dataset": long_dataset}
    run_dir = start_slow_run(ns, "oom", env, backoffLimit=2)
    (first,) = ns.pods_of("oom-r1")
    hsx_node.kill_container(ns.name, first["metadata"]["name"], "extractor", signal.SIGKILL)  # an OOM kill

    done = wait_for(phase(ns, "oom", "Succeeded", "Failed"), 420, "the run to end")
    assert done["phase"] == "Succeeded", done
    assert done["attempt"] == 2, done
    (second,) = [p for p in ns.pods_of("oom-r1") if p["metadata"]["name"] != first["metadata"]["name"]]
    store = run_store(env["output"], "r1")
    total = planned_shards(run_dir)
    assert store.committed_shards() == set(range(total))
    tokens_all = sum(sum(s.seq_len for s in store.read_header(k).samples) for k in range(total))
    _, _, tokens_second = final_log(hsx_node, ns.name, second["metadata"]["name"])
    assert 0 < tokens_second < tokens_all  # the retry extracted only what was not committed
    assert_each_row_once(run_dir, long_dataset)


def test_killed_operator_and_a_second_replica_neither_duplicate_the_job_nor_lose_status(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    start_operator: Callable[[], OperatorProcess],
) -> None:
    first = start_operator()
    env = {**run_env, "dataset": long_dataset}
    ns.apply(xj_manifest("opdies", "r1", **env, **SLOW))
    moving = wait_for(progressed(ns, "opdies"), 240, "progress")
    assert moving["phase"] == "Running", moving
    first.kill()
    seen = moving["progress"]["samplesDone"]
    time.sleep(QUIET_SECONDS)  # the run goes on with no operator; its status stands still
    assert ns.status("opdies")["progress"]["samplesDone"] == seen

    # Two replicas at once, both active (standalone): the worst case for duplicate Jobs.
    start_operator()
    start_operator()
    later = wait_for(
        lambda: (st := ns.status("opdies"))["progress"]["samplesDone"] > seen and st, 120, "status to move"
    )
    assert later["phase"] in ("Running", "Succeeded"), later
    done = wait_for(phase(ns, "opdies", "Succeeded", "Failed"), 420, "the run to end")
    assert done["phase"] == "Succeeded", done
    assert [j["metadata"]["name"] for j in ns.items("jobs")] == ["opdies-r1"]
    assert len(ns.pods_of("opdies-r1")) == 1 and done["attempt"] == 1
    assert ns.event_reasons("opdies").count("JobCreated") == 1
    assert (
        done["progress"]["samplesDone"] == rows_of(long_dataset) > done["progress"]["samplesQuarantined"] > 0
    )
    assert_each_row_once(env["output"] / "r1", long_dataset)


def test_two_replicas_split_the_shards_under_one_status_and_ttl_cleanup_keeps_it(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    start_operator()
    env = {**run_env, "dataset": long_dataset}
    run_dir = env["output"] / "r1"
    # 4 GPUs each, so both pods fit on the 8-GPU test node.
    ns.apply(xj_manifest("pair", "r1", **env, parallelism=2, server={"gpus": 4}, ttlSecondsAfterFinished=5))
    both = wait_for(lambda: len(ns.pods_of("pair-r1")) == 2 and ns.pods_of("pair-r1"), 120, "two pods")
    indexes = sorted(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in both)
    assert indexes == ["0", "1"]
    done = wait_for(phase(ns, "pair", "Succeeded", "Failed"), 420, "the run to end")
    assert done["phase"] == "Succeeded", done
    assert [r["index"] for r in done["replicas"]] == [0, 1], done["replicas"]
    rows = rows_of(long_dataset)
    assert done["progress"]["samplesDone"] == done["progress"]["samplesTotal"] == rows, done
    # Each replica reports the whole run as it has seen it: the run's count is the largest, not the sum.
    assert done["progress"]["samplesDone"] == max(r["samplesDone"] for r in done["replicas"])

    # Leased shards: together the pods committed every shard, each extracted the tokens of the shards it
    # committed (a shard raced at the end is in both lists: the loser adopted the winner's), each row once.
    store = run_store(env["output"], "r1")
    total = planned_shards(run_dir)
    assert total >= 2 and store.committed_shards() == set(range(total))
    tokens_of = {k: sum(s.seq_len for s in store.read_header(k).samples) for k in range(total)}
    lists = []
    for pod in both:
        _, _, tokens = final_log(hsx_node, ns.name, pod["metadata"]["name"])
        mine = committed_by(hsx_node.logs(ns.name, pod["metadata"]["name"], "extractor"))
        assert mine and tokens >= sum(tokens_of[k] for k in mine), (mine, tokens, tokens_of)
        lists.append(set(mine))
    assert lists[0] | lists[1] == set(range(total)), lists
    assert_each_row_once(run_dir, long_dataset)

    # TTL removes the finished Job; the run stays Succeeded and is not started again.
    wait_for(lambda: ns.get("job", "pair-r1") is None, 120, "TTL cleanup of the Job")
    time.sleep(QUIET_SECONDS)
    assert ns.get("job", "pair-r1") is None and not ns.pods_of("pair-r1")
    after = ns.status("pair")
    assert after["phase"] == "Succeeded" and after["progress"] == done["progress"], after


def test_a_failed_run_is_continued_by_a_new_run_id_without_losing_or_repeating_a_sample(
    ns: Namespace,
    run_env: dict[str, Any],
    long_dataset: Path,
    start_operator: Callable[[], OperatorProcess],
    hsx_node: Any,
) -> None:
    """A run that ran out of retries (backoffLimit 0, its extractor killed) ends Failed; `runId: r2` with
    `continueFrom: r1` keeps r1's shards byte for byte and extracts only the rest, each row once."""
    start_operator()
    env = {**run_env, "dataset": long_dataset}
    run_dir = start_slow_run(ns, "cont", env, backoffLimit=0)
    (first,) = ns.pods_of("cont-r1")
    hsx_node.kill_container(ns.name, first["metadata"]["name"], "extractor", signal.SIGKILL)
    failed = wait_for(phase(ns, "cont", "Failed", "Succeeded"), 240, "run r1 to fail")
    assert failed["phase"] == "Failed", failed
    kept = committed_files(run_dir, "r1")
    total = planned_shards(run_dir) if (run_dir / "plan.json").exists() else None
    assert kept, "nothing committed before the failure"

    ns.apply(xj_manifest("cont", "r2", **env, **SLOW, continueFrom="r1"))
    done = wait_for(
        lambda: (st := ns.status("cont")).get("observedRunId") == "r2" and st.get("phase") in ("Succeeded", "Failed") and st,
        420, "run r2 to end",
    )  # fmt: skip
    assert done["phase"] == "Succeeded", done
    assert done["output"]["prefix"].endswith("/r1/") and not (run_env["output"] / "r2").exists()
    after = committed_files(run_dir, "r1")
    assert {k: after[k] for k in kept} == kept  # r1's shards untouched
    store = run_store(env["output"], "r1")
    assert store.committed_shards() == set(range(total or planned_shards(run_dir)))
    (second,) = ns.pods_of("cont-r2")
    _, _, tokens_second = final_log(hsx_node, ns.name, second["metadata"]["name"])
    tokens_all = sum(sum(s.seq_len for s in store.read_header(k).samples) for k in store.committed_shards())
    assert 0 < tokens_second < tokens_all  # only what r1 had not committed
    assert_each_row_once(run_dir, long_dataset)
    assert [h["runId"] for h in done["history"]] == ["r1"] and done["history"][0]["phase"] == "Failed"
