"""An elastic run on the real control plane (issue 34, item 4): spec.parallelism changes while the run goes
on, 2 -> 4 -> 1, and a pod is deleted mid-shard. Shards are leased, so the pods that join take free shards,
the ones removed release theirs on SIGTERM, the deleted one's expire to its replacement: the run ends
Succeeded with every row once, and the status shows the pods and the shards as they went."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import patch_spec, phase, some_committed
from tests.operator.kube_helpers import Namespace, xj_manifest
from tests.operator.test_e2e_failures import assert_each_row_once
from tests.run.helpers import chat_rows, write_jsonl

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
INDEX = "batch.kubernetes.io/job-completion-index"
# Slower than e2e.SLOW, and long rows (a few to a shard): the run must outlast three changes of its fleet.
ELASTIC: dict[str, Any] = {
    "server": {"gpus": 2, "extraArgs": ["--delay-ms", "3000"]},
    "concurrency": 2,
    "backoffLimit": 10,
}


def running_indexes(ns: Namespace, job: str) -> list[int]:
    pods = [p for p in ns.pods_of(job) if not p["metadata"].get("deletionTimestamp")]
    return sorted(int(p["metadata"]["annotations"][INDEX]) for p in pods if p["status"].get("phase") == "Running")


def test_a_run_scaled_2_4_1_with_a_pod_deleted_mid_shard_stores_every_row_once(
    ns: Namespace,
    run_env: dict[str, Any],
    op_workdir: Path,
    start_operator: Callable[[], OperatorProcess],
) -> None:
    start_operator()
    (op_workdir / "data-elastic").mkdir(exist_ok=True)
    dataset = write_jsonl(op_workdir / "data-elastic" / "rows.jsonl", chat_rows(200, words=100))
    env = {**run_env, "dataset": dataset}
    ns.apply(xj_manifest("elastic", "r1", **env, parallelism=2, **ELASTIC))
    running = wait_for(phase(ns, "elastic", "Running", "Succeeded", "Failed"), 180, "Running")
    assert running["phase"] == "Running", running
    run_dir: Path = env["output"] / "r1"
    early = wait_for(some_committed(run_dir, "r1", ns, "elastic"), 240, "a committed shard")
    assert early != "ended", ("the run ended before it could be scaled; slow it down", ns.status("elastic"))

    patch_spec(ns, "elastic", {"parallelism": 4})
    wait_for(lambda: running_indexes(ns, "elastic-r1") == [0, 1, 2, 3], 240, "four running pods")
    job = ns.get("job", "elastic-r1")
    assert job is not None and (job["spec"]["parallelism"], job["spec"]["completions"]) == (4, 4)
    wide = ns.kubectl("get", "xj", "elastic", "-o", "wide").stdout
    assert "PODS" in wide and "SHARDS" in wide, wide
    leased = wait_for(lambda: (p := ns.status("elastic").get("progress", {})).get("shardsLeased", 0) >= 3 and p,
                      120, "the joined pods to lease shards")  # fmt: skip
    assert "leased" in leased["shards"], leased

    def pod_3_holds_a_shard() -> bool:
        return any(r["index"] == 3 and r.get("shardsLeased", 0) >= 1 for r in ns.status("elastic").get("replicas", []))

    # Its server starts before its extractor: delete it once it reports a lease, i.e. mid-shard.
    wait_for(pod_3_holds_a_shard, 240, "pod 3 to lease a shard")
    (victim,) = [p for p in ns.pods_of("elastic-r1") if p["metadata"]["annotations"][INDEX] == "3"]
    ns.kubectl("delete", "pod", victim["metadata"]["name"], "--wait=false")

    patch_spec(ns, "elastic", {"parallelism": 1})
    wait_for(lambda: running_indexes(ns, "elastic-r1") == [0], 240, "the fleet to shrink to pod 0")
    done = wait_for(phase(ns, "elastic", "Succeeded", "Failed"), 900, "the run to end")
    assert done["phase"] == "Succeeded", done
    reasons = ns.event_reasons("elastic")
    assert reasons.count("Scaled") == 2, reasons
    assert {r["index"] for r in done["replicas"]} == {0, 1, 2, 3}, done["replicas"]
    p = done["progress"]
    assert p["samplesDone"] == p["samplesTotal"] > 0 and p["shards"] == f"{p['shardsTotal']}/{p['shardsTotal']}", p
    assert_each_row_once(run_dir, dataset)
