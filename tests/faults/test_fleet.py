"""A run as a fleet (issue 34, item 1): four real ``hsx extract`` processes on one runId against the real S3
server, each with its own reference server as four pods would have. One server is 5x slower, one extractor
is SIGKILLed twice and restarted (same replica index, as the Job replaces its pod), one joins late. Shards
are leased, not assigned: every process exits 0, every sample is stored exactly once, and the samples are
byte for byte those of a one-replica run on the same deterministic server; the slow member does fewer
shards than the fastest instead of holding a fixed share. How close to the ideal time a fleet ends is
measured, not asserted: bench/fleet_tail.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.faults.helpers import (
    RefServerProcess,
    committed_by,
    free_port,
    hsx_verify,
    sigkill,
    start_extract,
    stored,
)
from tests.run.helpers import chat_rows, write_jsonl

pytestmark = [pytest.mark.s3, pytest.mark.slow]
ROWS = 240
DELAY_MS = 300  # every server's prefill wait: the fleet's speeds are these delays, not this VM's cores
SLOW = 5


def config(path: Path, run_id: str, dataset: Path, output: dict[str, Any], server: RefServerProcess,
           model: Path, replica: int, count: int) -> Path:  # fmt: skip
    path.write_text(json.dumps({
        "runId": run_id, "dataset": {"uri": str(dataset), "maxLength": 512}, "output": output,
        "modelPath": str(model), "serverUrl": server.url, "dumpDir": str(server.dump_dir), "concurrency": 2,
        "progressPort": 0, "logIntervalSeconds": 60, "replicaIndex": replica, "replicaCount": count,
        "leaseSeconds": 2, "validation": {"consistency": {"samplesPerShard": 0}},
    }))  # fmt: skip
    return path


def test_a_fleet_with_a_slow_a_killed_and_a_late_member_stores_every_sample_once(
    tmp_path: Path, fault_model: Path, s3_env: Any, s3_bucket: str
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(ROWS, words=100))
    output = {"uri": f"s3://{s3_bucket}/fleet", "endpoint": s3_env.endpoint, "pathStyle": True,
              "shardTargetBytes": 1 << 20}  # fmt: skip
    servers = []
    for member in range(4):
        delay = DELAY_MS * (SLOW if member == 1 else 1)
        server = RefServerProcess(fault_model, tmp_path / f"dumps-{member}", free_port(),
                                  tmp_path / f"server-{member}.log", "--delay-ms", str(delay))  # fmt: skip
        servers.append(server)
    procs: dict[int, Any] = {}
    logs = [tmp_path / f"extract-{member}.log" for member in range(4)]
    try:
        for server in servers:
            server.start()
        # The baseline: one replica alone, on the same (deterministic) server as member 0.
        base = config(tmp_path / "base.json", "base", dataset, output, servers[0], fault_model, 0, 1)
        assert start_extract(base, tmp_path / "base.log").wait(timeout=600) == 0, (tmp_path / "base.log").read_text()
        configs = [config(tmp_path / f"c{m}.json", "fleet", dataset, output, servers[m], fault_model, m, 4)
                   for m in range(4)]  # fmt: skip
        for member in (0, 1, 2):
            procs[member] = start_extract(configs[member], logs[member])
        for _ in range(2):  # member 2 dies twice mid-run, without a word, and its pod comes back
            time.sleep(4)
            sigkill(procs[2])
            procs[2] = start_extract(configs[2], logs[2])
            if 3 not in procs:
                procs[3] = start_extract(configs[3], logs[3])  # the late joiner
        codes = {m: p.wait(timeout=900) for m, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                sigkill(p)
        for server in servers:
            server.stop()
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}, "\n\n".join(log.read_text()[-3000:] for log in logs)
    report = hsx_verify(f"s3://{s3_bucket}/fleet/fleet")
    assert report["ok"] and report["manifest"] and report["duplicates"] == 0, report
    fleet, fleet_quarantined = stored(output, "fleet")
    alone, alone_quarantined = stored(output, "base")
    assert sorted(fleet) == sorted(alone) == list(range(ROWS)) and not fleet_quarantined and not alone_quarantined
    for index, sample in fleet.items():
        ref = alone[index]
        for field in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states"):
            assert np.array_equal(getattr(sample, field), getattr(ref, field)), (index, field)
    shards = {m: committed_by(log.read_text()) for m, log in enumerate(logs)}
    assert shards[1] and len(shards[1]) < max(len(shards[0]), len(shards[3])), shards  # the slow one did less
    assert shards[3], f"the late joiner leased nothing: {shards}"
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_bucket, Prefix="fleet/fleet/leases/")
            .get("Contents", [])]  # fmt: skip
    assert not keys, f"lease objects outlived the manifest: {keys}"
