"""R1: SIGKILL ``hsx extract`` at 20+ random points of one run (to S3); after restarts the output
verifies and every good sample is stored exactly once, with the tokens of its row."""

from __future__ import annotations

import json
import random
import time
import urllib.request
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
KILLS = 20
ROWS = 160


def progress_state(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=1) as r:
            return str(json.loads(r.read())["state"])
    except OSError:
        return None


def test_sigkill_at_random_points_loses_and_duplicates_nothing(
    tmp_path: Path, fault_model: Path, fault_tokenizer: Any, s3_env: Any, s3_bucket: str
) -> None:
    rng = random.Random(fault_seed("R1"))
    rows: list[Any] = [*chat_rows(ROWS, words=30), "{not json", {"id": "empty", "messages": []}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    server = RefServerProcess(fault_model, tmp_path / "dumps", free_port(), tmp_path / "server.log",
                              "--delay-ms", "150")
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
    kills: list[tuple[str, float, int]] = []
    try:
        for n in range(KILLS):
            proc = start_extract(config, log)
            started = time.monotonic()
            # Some kills land during start-up (cheap: a start costs ~10 s of imports here); most mid-run.
            if rng.random() < 0.35:
                when, phase = rng.uniform(0.05, 2.0), "start-up"
                time.sleep(when)
            else:
                while progress_state(progress_port) != "running" and proc.poll() is None:
                    time.sleep(0.02)
                when, phase = rng.uniform(0.0, 1.6), "running"
                time.sleep(when)
            code = sigkill(proc)
            assert code is None, f"attempt {n} ended by itself with exit {code}:\n{log.read_text()[-3000:]}"
            kills.append((phase, round(time.monotonic() - started, 2), committed_count(output, "r1")))
        print(f"kills (phase, seconds after start, shards committed): {kills}")
        final = start_extract(config, log)
        assert final.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        server.stop()
    plan = json.loads(s3_env.client().get_object(Bucket=s3_bucket, Key="r1/r1/plan.json")["Body"].read())
    shards = len(plan["shards"])
    assert shards >= 6, plan
    # The kills spread over the run: some before any shard was committed, some with most done.
    assert sum(1 for phase, _, _ in kills if phase == "running") >= 10
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
