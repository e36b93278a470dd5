"""Issue 14 item 4, issue 34 item 2: a duplicate pod (two real ``hsx extract`` processes on one runId, each with
its own reference server and dump directory, as two pods would have) on a store that honours ``If-None-Match``
must not fail the run. Each server adds its own noise to the states (the last bit of random bf16 values, as GPUs
differ from run to run), so the two writers' shards differ in their bytes: the loser of each commit adopts the
winner's shard because the samples (ids, tokens, masks, quarantined rows) agree. Rows quarantined by a server
error carry the request id in their free-text detail, so the records differ there too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.faults.helpers import RefServerProcess, free_port, hsx_verify, start_extract, stored
from tests.run.helpers import chat_rows, write_jsonl

pytestmark = [pytest.mark.s3, pytest.mark.slow]
ROWS = 24
EVERY = 10  # the reference server spoils rows 0, 10 and 20 (an error marker instead of a dump)


def test_duplicate_writers_on_one_run_both_succeed(
    tmp_path: Path, fault_model: Path, s3_env: Any, s3_bucket: str
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", [*chat_rows(ROWS, words=20), {"id": "e", "messages": []}])
    output = {"uri": f"s3://{s3_bucket}/dup", "endpoint": s3_env.endpoint, "pathStyle": True,
              "shardTargetBytes": 1 << 20}
    servers, procs, logs = [], [], []
    try:
        for seed, pod in enumerate("ab"):
            dumps = tmp_path / f"dumps-{pod}"
            server = RefServerProcess(fault_model, dumps, free_port(), tmp_path / f"server-{pod}.log",
                                      "--fault", "error", "--fault-every", str(EVERY), "--noise-seed", str(seed))
            server.start()
            servers.append(server)
            config = tmp_path / f"config-{pod}.json"
            config.write_text(json.dumps({
                "runId": "dup",
                "dataset": {"uri": str(dataset), "maxLength": 512},
                "output": output,
                "modelPath": str(fault_model),
                "serverUrl": server.url,
                "dumpDir": str(dumps),
                "concurrency": 2,
                "progressPort": 0,
                "logIntervalSeconds": 60,
                "validation": {"maxMismatchRate": 0.5},
            }))
            logs.append(tmp_path / f"extract-{pod}.log")
        procs = [start_extract(tmp_path / f"config-{pod}.json", log) for pod, log in zip("ab", logs, strict=True)]
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for server in servers:
            server.stop()
    assert codes == [0, 0], "\n\n".join(log.read_text()[-3000:] for log in logs)
    report = hsx_verify(f"s3://{s3_bucket}/dup/dup")
    assert report["ok"] and report["manifest"] and report["duplicates"] == 0, report
    samples, quarantined = stored(output, "dup")
    spoiled = set(range(0, ROWS, EVERY))
    assert sorted(samples) == [i for i in range(ROWS) if i not in spoiled]
    assert set(quarantined) == spoiled | {ROWS} and quarantined[ROWS] == "empty_messages", quarantined
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_bucket, Prefix="dup/dup/").get("Contents", [])]
    shard_objects = [k for k in keys if "/shards/" in k]
    commits = [k for k in keys if "/commits/" in k]
    assert len(shard_objects) == len(commits) >= 1, keys  # one object per shard: nothing left over
    # Both wrote every shard (static assignment: same replica), with other bytes: one object per shard was
    # committed and the loser's, named by its own checksum, was deleted, never mixed in.
    commit_keys = {json.loads(s3_env.client().get_object(Bucket=s3_bucket, Key=k)["Body"].read())["key"] for k in commits}
    assert commit_keys == set(shard_objects), (commit_keys, shard_objects)


def test_the_noise_hook_changes_last_bits_only(fault_model: Path) -> None:
    """What makes the two writers above differ: per-server noise in the states' last bit, nothing else."""
    import numpy as np

    from hsx_extractor.tools.reference_server import ReferenceModel

    model = ReferenceModel(fault_model)
    plain = model.forward([1, 5, 9, 13])
    noisy = []
    for seed in (0, 1):
        model.noise = np.random.default_rng(seed)
        noisy.append(model.forward([1, 5, 9, 13]))
    for a, b in ((noisy[0].aux, noisy[1].aux), (noisy[0].final, noisy[1].final)):
        assert (a != b).any() and ((a ^ b) <= 1).all()
    assert ((plain.aux ^ noisy[0].aux) <= 1).all() and plain.next_token == noisy[0].next_token
