"""R2: a whole ``hsx extract`` (dataset read from S3, shards written to S3) through a proxy that
breaks ~10% of S3 requests (503 SlowDown, resets before and after the upstream ran, slow
answers) completes in one go and verifies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.faults.helpers import RefServerProcess, fault_seed, free_port, hsx_verify, start_extract, stored
from tests.run.helpers import chat_rows, write_jsonl
from tests.storage.faultproxy import FAULTS, FaultPlan, FaultProxy

pytestmark = [pytest.mark.s3, pytest.mark.slow]
ROWS = 120


def test_extract_through_s3_faults_completes_and_verifies(
    tmp_path: Path, fault_model: Path, s3_env: Any, s3_bucket: str
) -> None:
    seed = fault_seed("R2 fault proxy")
    local = write_jsonl(tmp_path / "d.jsonl", [*chat_rows(ROWS, words=30), {"id": "e", "messages": []}])
    s3_env.client().upload_file(str(local), s3_bucket, "datasets/chat.jsonl")
    server = RefServerProcess(fault_model, tmp_path / "dumps", free_port(), tmp_path / "server.log")
    server.start()
    plan = FaultPlan(seed=seed, rate=0.1, faults=FAULTS, slow_seconds=0.3, fault_every=15)
    try:
        with FaultProxy(s3_env.endpoint, plan) as proxy:
            output = {"uri": f"s3://{s3_bucket}/r2", "endpoint": proxy.endpoint, "pathStyle": True,
                      "shardTargetBytes": 1 << 20}
            config = tmp_path / "config.json"
            config.write_text(json.dumps({
                "runId": "r2",
                "dataset": {"uri": f"s3://{s3_bucket}/datasets/chat.jsonl", "maxLength": 512},
                "output": output,
                "modelPath": str(fault_model),
                "serverUrl": server.url,
                "dumpDir": str(tmp_path / "dumps"),
                "concurrency": 4,
                "progressPort": 0,
                "logIntervalSeconds": 60,
            }))
            log = tmp_path / "extract.log"
            proc = start_extract(config, log)
            assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
            counts = dict(proxy.counts)
    finally:
        server.stop()
    print(f"fault counts {counts}")
    assert counts["requests"] >= 50 and sum(counts.get(f, 0) for f in FAULTS) >= 3, counts
    # Verified around the proxy, straight from the server: what the store really holds.
    direct = {**output, "endpoint": s3_env.endpoint}
    report = hsx_verify(f"s3://{s3_bucket}/r2/r2", env={"AWS_ENDPOINT_URL_S3": s3_env.endpoint})
    assert report["ok"] and report["manifest"] and report["duplicates"] == 0, report
    assert report["samples"] == ROWS and report["samplesChecked"] == ROWS and report["quarantined"] == 1
    samples, quarantined = stored(direct, "r2")
    assert sorted(samples) == list(range(ROWS)) and quarantined == {ROWS: "empty_messages"}
    assert s3_env.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
