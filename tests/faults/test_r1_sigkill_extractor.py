"""R1: SIGKILL ``hsx extract`` at 20+ random points of one run (to S3); after restarts the output
verifies and every good sample is stored exactly once, with the tokens of its row."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.run.dataset import Prepared, read_samples
from hsx_extractor.run.sources import iter_rows
from tests.faults.helpers import (
    RefServerProcess,
    committed_count,
    fault_seed,
    free_port,
    hsx_verify,
    sigkill,
    start_extract,
    stored,
)
from tests.run.helpers import chat_rows, write_jsonl

pytestmark = [pytest.mark.s3, pytest.mark.slow]
ROWS = 160
# Where the 20 kills land, in an order and at moments the seed draws. Counts are fixed so that any
# seed kills mid-run often and still leaves work for the last kill: "start-up" kills come before the
# first request; "mid-shard" ones within 8 samples of an attempt's first request (a shard holds ~15
# rows, so they never commit one); "after-commit" ones just after the attempt committed a shard.
KINDS = ["start-up"] * 6 + ["mid-shard"] * 10 + ["after-commit"] * 4
WAIT_S = 120


def progress(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=1) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except OSError:
        return None


def wait_until(proc: Any, what: str, ready: Callable[[], Any], log: Path) -> Any:
    """``ready()``'s first truthy value, polled every 20 ms while the attempt lives."""
    deadline = time.monotonic() + WAIT_S
    while not (seen := ready()):
        assert proc.poll() is None, f"the attempt ended by itself ({proc.poll()}) waiting for {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {WAIT_S}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.02)
    return seen


def test_sigkill_at_random_points_loses_and_duplicates_nothing(
    tmp_path: Path, fault_model: Path, fault_tokenizer: Any, s3_env: Any, s3_bucket: str
) -> None:
    rng = random.Random(fault_seed("R1"))
    kinds = list(KINDS)
    rng.shuffle(kinds)
    rows: list[Any] = [*chat_rows(ROWS, words=30), "{not json", {"id": "empty", "messages": []}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    # 300 ms a request: an attempt's work outlasts the polls that find it running even on a loaded
    # machine (make test runs this beside the control-plane tests; at 150 ms one attempt once finished
    # its last ~50 samples before any poll answered).
    server = RefServerProcess(fault_model, tmp_path / "dumps", free_port(), tmp_path / "server.log",
                              "--delay-ms", "300")
    server.start()
    progress_port = free_port()
    output = {"uri": f"s3://{s3_bucket}/r1", "endpoint": s3_env.endpoint, "pathStyle": True,
              "shardTargetBytes": 1 << 20}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "runId": "r1",
        "dataset": {"uri": str(dataset), "maxLength": 512},
        "output": output,
        "modelPath": str(fault_model),
        "serverUrl": server.url,
        "dumpDir": str(tmp_path / "dumps"),
        "concurrency": 4,
        "progressPort": progress_port,
        "progressHost": "127.0.0.1",
        "logIntervalSeconds": 60,
        "validation": {"dumpTimeoutSeconds": 10},
    }))
    log = tmp_path / "extract.log"

    def planned_shards() -> int | None:
        try:
            body = s3_env.client().get_object(Bucket=s3_bucket, Key="r1/r1/plan.json")["Body"].read()
        except Exception:
            return None
        return len(json.loads(body)["shards"])

    def running() -> dict[str, Any] | None:
        seen = progress(progress_port)
        return seen if seen is not None and seen["state"] == "running" else None

    kills: list[tuple[str, float, int]] = []
    try:
        for kind in kinds:
            proc = start_extract(config, log)
            started = time.monotonic()
            if kind == "start-up":  # a start costs seconds of imports; kill before the first request
                until = started + rng.uniform(0.05, 2.0)
                wait_until(proc, "start-up", lambda until=until: time.monotonic() >= until or running(), log)
            else:
                seen = wait_until(proc, "running", running, log)
                base, total = seen["samplesDone"], seen["samplesTotal"]
                shards, before = planned_shards(), committed_count(output, "r1")
                if kind == "after-commit" and shards is not None and before < shards - 1:
                    wait_until(proc, "a commit", lambda before=before: committed_count(output, "r1") > before, log)
                    time.sleep(rng.uniform(0.0, 0.3))
                else:  # also instead of a commit that would finish the run: the last kill must leave work
                    kind = "mid-shard"
                    # Never past the run's last samples: the kill must find the attempt still working.
                    target = min(base + rng.randint(1, 8), max(base, total - 4))
                    wait_until(proc, f"{target} samples done",
                               lambda target=target: (progress(progress_port) or {}).get("samplesDone", 0) >= target, log)
            code = sigkill(proc)
            assert code is None, f"a {kind} attempt ended by itself with exit {code}:\n{log.read_text()[-3000:]}"
            kills.append((kind, round(time.monotonic() - started, 2), committed_count(output, "r1")))
        print(f"kills (kind, seconds after start, shards committed): {kills}")
        final = start_extract(config, log)
        assert final.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        server.stop()
    plan = json.loads(s3_env.client().get_object(Bucket=s3_bucket, Key="r1/r1/plan.json")["Body"].read())
    shards = len(plan["shards"])
    assert shards >= 6, plan
    # The kills spread over the run: mid-run ones, some before any shard was committed, some later.
    assert sum(1 for kind, _, _ in kills if kind != "start-up") == len(KINDS) - KINDS.count("start-up")
    assert kills[-1][2] < shards, "every shard was committed before the last kill: the kills missed the run"
    assert len({c for _, _, c in kills}) >= 3, kills

    report = hsx_verify(f"s3://{s3_bucket}/r1/r1", env=s3_env.env() | {"AWS_ENDPOINT_URL_S3": s3_env.endpoint})
    assert report["ok"] and report["manifest"] and report["duplicates"] == 0, report
    samples, quarantined = stored(output, "r1")
    want = {s.index: s for s in read_samples(iter_rows(str(dataset)), fault_tokenizer, 512)
            if isinstance(s, Prepared)}
    assert sorted(samples) == sorted(want) and len(want) == ROWS
    assert quarantined == {ROWS: "invalid_json", ROWS + 1: "empty_messages"}
    for index, rec in samples.items():
        assert rec.input_ids.tolist() == want[index].input_ids.tolist()
        assert rec.loss_mask.tolist() == want[index].loss_mask.tolist()
    assert report["samples"] == ROWS and report["samplesChecked"] == ROWS
    # No unfinished multipart upload is left behind by the killed processes.
    assert s3_env.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
