"""Kills at every named step of the commit protocol (storage/failpoints.py), not just where random
kills happen to land: each run is SIGKILLed at one step, resumed by a fresh ``hsx extract``, and must
end with exactly what an undisturbed run stored (same content-addressed shard keys, same samples),
no multipart upload left open, and ``hsx verify`` passing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage import failpoints
from hsx_extractor.storage.store import open_store
from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tiny_model
from tests.faults.helpers import RefServerProcess, free_port, hsx_verify, start_extract, stored
from tests.run.helpers import chat_rows, write_jsonl

pytestmark = [pytest.mark.s3, pytest.mark.slow]
ROWS = 40
# Hidden 512: 4 KiB of bf16 states per token, so a 6 MiB shard is a 2-part multipart upload
# (parts are at least 5 MiB) and "part-uploaded" falls between its parts.
MODEL = TinyModelSpec(num_layers=4, hidden_size=512, intermediate_size=512, num_heads=4, num_kv_heads=2)


def shard_keys(output: dict[str, Any], run_id: str) -> list[str]:
    store = open_store(OutputSpec.model_validate(output), run_id, writing=False)
    return sorted(store.shard_object_key(k).rsplit("/", 1)[-1] for k in store.committed_shards())


def test_a_kill_at_every_commit_step_resumes_to_the_undisturbed_output(
    tmp_path: Path, s3_env: Any, s3_bucket: str
) -> None:
    model = build_tiny_model(tmp_path / "model", MODEL)
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(ROWS, words=50))
    server = RefServerProcess(model, tmp_path / "dumps", free_port(), tmp_path / "server.log")
    server.start()
    output = {
        "uri": f"s3://{s3_bucket}/phases",
        "endpoint": s3_env.endpoint,
        "pathStyle": True,
        "compression": "none",
        "shardTargetBytes": 6 << 20,
        "uploadConcurrency": 2,
    }

    def config(run_id: str) -> Path:
        path = tmp_path / f"{run_id}.json"
        path.write_text(json.dumps({
            "runId": run_id,
            "dataset": {"uri": str(dataset), "maxLength": 1024},
            "output": output,
            "modelPath": str(model),
            "serverUrl": server.url,
            "dumpDir": str(tmp_path / "dumps"),
            "concurrency": 4,
            "progressPort": 0,
            "logIntervalSeconds": 60,
        }))  # fmt: skip
        return path

    def extract(run_id: str, kill_at: str | None = None) -> tuple[int, str]:
        log = tmp_path / f"{run_id}.log"
        env = {failpoints.ENV: kill_at} if kill_at else {}
        code = start_extract(config(run_id), log, env).wait(timeout=300)
        return code, log.read_text()

    try:
        code, log = extract("undisturbed")
        assert code == 0, log[-3000:]
        want_keys = shard_keys(output, "undisturbed")
        want, _ = stored(output, "undisturbed")
        assert len(want_keys) >= 2 and len(want) == ROWS, want_keys
        for point in failpoints.COMMIT_POINTS:
            run_id = f"kill-{point}"
            code, log = extract(run_id, f"{point}#1")
            assert code == -9 and f"killed at {point} #1" in log, (point, code, log[-3000:])
            code, log = extract(run_id)
            assert code == 0, (point, log[-3000:])
            assert shard_keys(output, run_id) == want_keys, point
            got, quarantined = stored(output, run_id)
            assert quarantined == {} and sorted(got) == sorted(want), point
            for index, rec in got.items():
                ref = want[index]
                assert rec.input_ids.tolist() == ref.input_ids.tolist(), (point, index)
                assert np.array_equal(rec.hidden_states, ref.hidden_states), (point, index)
                assert np.array_equal(rec.aux_hidden_states, ref.aux_hidden_states), (point, index)
            env = s3_env.env() | {"AWS_ENDPOINT_URL_S3": s3_env.endpoint}
            report = hsx_verify(f"s3://{s3_bucket}/phases/{run_id}", env=env)
            assert report["ok"] and report["manifest"] and report["duplicates"] == 0, (point, report)
            uploads = s3_env.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
            assert uploads == [], (point, uploads)
    finally:
        server.stop()
