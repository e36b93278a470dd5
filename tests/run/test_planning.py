"""Planning ahead: a row's shard is known as soon as the planning thread read it, long before the
thread reaches the dataset's end; its errors reach the reader; a stopped run stops it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK
from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import Prepared, Rejected
from hsx_extractor.run.plan import Planner, ShardPlan, bytes_per_sample
from hsx_extractor.run.planning import PlanAhead, PlanStopped
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.runner import extract
from tests.run.helpers import RefServer, base_config, chat_rows, write_jsonl
from tests.storage.faultproxy import FaultPlan, FaultProxy, Injection

# How long the proxy holds the PUT of plan.json: far longer than the first shard takes.
PLAN_HELD_S = 20.0


def _sample(index: int, sample_id: str) -> Prepared:
    ids = np.ones(4, np.int32)
    return Prepared(index, sample_id, ids, np.ones(4, np.uint8), index + 1)


def _planner() -> Planner:
    return Planner({}, 3, 8, 2 * bytes_per_sample(4, 3, 8), {})


def test_rows_are_placed_before_the_pass_ends_and_the_plan_comes_at_the_end() -> None:
    gate = threading.Event()

    def items() -> Iterator[Prepared | Rejected]:
        yield _sample(0, "a")
        yield _sample(1, "a")  # a repeated id: placed, flagged, weighs nothing
        yield _sample(2, "b")
        gate.wait(30)  # the rest of the dataset is slow to read
        yield Rejected(3, None, Reason.INVALID_JSON, "bad", 4)
        yield _sample(4, "c")

    def finish(planner: Planner, last_line: int) -> ShardPlan:
        return planner.finish(last_line)[1]

    ahead = PlanAhead(items, _planner(), finish)
    ahead.start()
    try:
        assert [ahead.placement(i) for i in range(3)] == [
            (p := ahead.placement(0)),
            type(p)(0, True),
            type(p)(0, False),
        ]
        assert p is not None and (p.shard, p.duplicate) == (0, False)
        assert [c.shard for c in ahead.cuts(0)] == [0]  # rows 0-2 reached the target
        gate.set()
        assert ahead.placement(4) == type(p)(1, False)
        assert ahead.placement(5) is None  # past the end
        plan = ahead.plan()
    finally:
        ahead.stop()
    assert plan.shards == [(0, 3), (3, 5)] and plan.duplicates == {1}
    assert ahead.placed() == (5, 2, True) and [c.shard for c in ahead.cuts(0)] == [0, 1]


def test_placed_counts_only_the_counted_shards() -> None:
    rows = [_sample(i, str(i)) for i in range(7)]  # two rows reach the target: shards of 2, 2, 2, 1
    ahead = PlanAhead(lambda: rows, _planner(), lambda planner, line: planner.finish(line)[1], counted=lambda k: k % 2 == 1)
    ahead.start()
    assert ahead.plan().shards == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert ahead.placed() == (3, 2, True)  # shards 1 and 3: rows 2, 3 and 6


def test_a_planning_error_reaches_the_reader() -> None:
    def items() -> Iterator[Prepared | Rejected]:
        yield _sample(0, "a")
        raise ValueError("the dataset went away")

    ahead = PlanAhead(items, _planner(), lambda planner, line: planner.finish(line)[1])
    ahead.start()
    assert ahead.placement(0) is not None
    with pytest.raises(ValueError, match="went away"):
        ahead.placement(1)
    with pytest.raises(ValueError, match="went away"):
        ahead.plan()


def test_stop_releases_a_waiting_reader_and_ends_the_thread() -> None:
    gate = threading.Event()

    def items() -> Iterator[Prepared | Rejected]:
        yield _sample(0, "a")
        gate.wait(30)
        yield _sample(1, "b")
        yield _sample(2, "c")

    ahead = PlanAhead(items, _planner(), lambda planner, line: planner.finish(line)[1])
    ahead.start()
    assert ahead.placement(0) is not None
    waiting: list[BaseException] = []

    def read() -> None:
        try:
            ahead.placement(2)
        except PlanStopped as exc:
            waiting.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    ahead.stop()
    reader.join(10)
    gate.set()
    ahead.join(10)
    assert waiting and not reader.is_alive()


def test_a_fresh_run_commits_shards_before_its_plan_is_stored(
    tmp_path: Path, ref_server: RefServer, s3_env: Any, s3_bucket: str
) -> None:
    """No plan.json yet: extraction does not wait for the planning pass. Storing plan.json is held back
    (a proxy in front of the real S3 server delays that PUT); shards are committed meanwhile."""
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(60, words=30))
    held = Injection("PUT", "plan.json", delay_seconds=PLAN_HELD_S)
    with FaultProxy(s3_env.endpoint, FaultPlan(seed=0, rate=0.0, injections=[held])) as proxy:
        output = {"uri": f"s3://{s3_bucket}/out", "endpoint": proxy.endpoint, "pathStyle": True}
        cfg = base_config(tmp_path, ref_server, dataset, run_id="ahead", output=output)
        cfg["output"]["shardTargetBytes"] = 1 << 20
        config = ExtractConfig.model_validate(cfg)
        progress = Progress(config.runId, 0)
        result: list[int] = []
        run = threading.Thread(target=lambda: result.append(asyncio.run(extract(config, progress))[0]))
        run.start()
        client = s3_env.client()

        def keys() -> list[str]:
            listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="out/ahead/")
            return [o["Key"] for o in listed.get("Contents", [])]

        deadline = time.monotonic() + PLAN_HELD_S
        while not any("/commits/" in k for k in keys()) and time.monotonic() < deadline and run.is_alive():
            time.sleep(0.1)
        seen = keys()
        planning = progress.planning
        run.join(120)
    assert result == [EXIT_OK], progress.last_error
    assert any("/commits/" in k for k in seen), f"no shard committed while plan.json was held back: {seen}"
    assert "out/ahead/plan.json" not in seen and planning
    assert "out/ahead/plan.json" in keys() and progress.samples_total == progress.samples_done == 60


def test_progress_totals_follow_the_planning_thread_and_end_when_the_plan_is_made() -> None:
    seen = [(3, 1, False), (10, 2, True)]
    progress = Progress("run", 0)
    progress.watch_planning(lambda: seen[0])
    progress.mark_running()
    progress.sample_done(5)
    during = progress.report()
    assert during.planning and (during.samplesTotal, during.shardsTotal) == (3, 1) and during.etaSeconds is None
    seen.pop(0)  # the plan is made while extraction goes on: totals final, ETA back
    after = progress.report()
    assert not after.planning and (after.samplesTotal, after.shardsTotal) == (10, 2)
    assert not progress.planning and after.etaSeconds is not None


def test_the_bytes_read_estimate_the_total_and_the_eta_while_planning(tmp_path: Path) -> None:
    from hsx_extractor.run.planning import ReadFraction
    from hsx_extractor.run.sources import iter_rows

    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    read = ReadFraction(str(dataset), lambda: dataset.stat().st_size)
    rows = read.count(iter_rows(str(dataset)))
    for _ in range(10):
        next(rows)
    assert 0.2 < read.fraction() < 0.3  # type: ignore[operator]
    list(rows)
    assert read.fraction() == 1.0
    assert ReadFraction(str(tmp_path / "d.jsonl.gz"), lambda: 1000).fraction() is None  # compressed: unknown
    assert ReadFraction(str(tmp_path / "absent.jsonl"), lambda: (tmp_path / "absent.jsonl").stat().st_size).fraction() is None
    progress = Progress("run", 0)
    progress.watch_planning(lambda: (10, 1, False), lambda: 0.25)
    progress.mark_running()
    for _ in range(5):
        progress.sample_done(7)
    report = progress.report()
    assert report.samplesTotalEstimate == 40 and report.samplesTotal == 10 and report.etaSeconds is not None
    tiny = Progress("run", 0)
    tiny.watch_planning(lambda: (10, 1, False), lambda: 0.001)  # too little read to say
    assert tiny.report().samplesTotalEstimate is None


def test_replicas_plan_ahead_with_turns_that_straddle_shards(tmp_path: Path, ref_server: RefServer) -> None:
    """expandTurns: one row's samples may fall in two shards leased by two replicas running at once; each
    replica extracts only its own shards' samples, and together they hold every sample once."""
    rows = []
    for i in range(40):
        words = " ".join(["alpha beta gamma delta capital plus times code tests small"] * (1 + i * 7 % 5))
        messages = []
        for t in range(3):
            messages += [{"role": "user", "content": f"Question {i}.{t}: {words}?"},
                         {"role": "assistant", "content": f"Answer {i}.{t}: {words}."}]
        rows.append({"id": f"m{i}", "messages": messages})
    dataset = write_jsonl(tmp_path / "turns.jsonl", rows)
    configs, progress = [], []
    for replica in (0, 1):
        cfg = base_config(tmp_path, ref_server, dataset, run_id="turns", dataset__expandTurns=True,
                          replicaIndex=replica, replicaCount=2, concurrency=2, leaseSeconds=2)
        cfg["output"]["shardTargetBytes"] = 1 << 20
        configs.append(ExtractConfig.model_validate(cfg))
        progress.append(Progress("turns", replica))

    async def both() -> list[tuple[int, Any]]:
        return await asyncio.gather(*(extract(c, p) for c, p in zip(configs, progress, strict=True)))

    outcomes = asyncio.run(both())
    assert [code for code, _ in outcomes] == [EXIT_OK, EXIT_OK], [p.last_error for p in progress]
    run_dir = tmp_path / "out" / "turns"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["rows"] == 120 and len(plan["shards"]) >= 4 and any(s["start"] % 3 for s in plan["shards"]), "no row straddles two shards"
    commits = [json.loads(p.read_text()) for p in sorted((run_dir / "commits").iterdir())]
    held = sorted(i for c in commits for i in [*c["samples"], *(q["index"] for q in c["quarantined"])])
    assert held == list(range(120)) and (run_dir / "manifest.json").is_file()
    assert progress[0].samples_total == progress[1].samples_total == 120  # each reports the run
