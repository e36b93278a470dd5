"""R3: the extraction server is SIGKILLed with requests in flight and restarted at the same
address. No dump may be attached to the wrong request: every stored sample must be
byte-identical to the same sample from an undisturbed run, and the run must complete (in the
same process if the client's retries bridge the gap, else after a resume)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK, EXIT_TRANSIENT
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.runner import extract
from tests.faults.helpers import RefServerProcess, fault_seed, free_port, hsx_verify, stored
from tests.run.helpers import chat_rows, write_jsonl

pytestmark = pytest.mark.slow
ROWS = 80


def config(tmp_path: Path, model: Path, dataset: Path, url: str, run_id: str) -> dict[str, Any]:
    return {
        "runId": run_id,
        "dataset": {"uri": str(dataset), "maxLength": 512},
        "output": {"uri": str(tmp_path / "out"), "shardTargetBytes": 1 << 20},
        "modelPath": str(model),
        "serverUrl": url,
        "dumpDir": str(tmp_path / "dumps"),
        "concurrency": 6,
        "progressPort": 0,
        "logIntervalSeconds": 60,
        "validation": {"dumpTimeoutSeconds": 20},
    }


def run_once(cfg: dict[str, Any]) -> int:
    code, _ = asyncio.run(extract(ExtractConfig.model_validate(cfg)))
    return code


async def run_and_kill_server(
    cfg: dict[str, Any], server: RefServerProcess, after_samples: int, down_s: float
) -> tuple[int, int]:
    """Run; once requests are in flight and ``after_samples`` samples are done, SIGKILL the server,
    keep it down ``down_s`` seconds, restart it. Returns (exit code, requests in flight at the kill)."""
    progress = Progress(cfg["runId"], 0)
    task = asyncio.create_task(extract(ExtractConfig.model_validate(cfg), progress))
    deadline = time.monotonic() + 120
    while not (progress.samples_done >= after_samples and progress.snapshot()["requestsInFlight"] >= 2):
        assert not task.done() and time.monotonic() < deadline, "the run ended before the server could be killed"
        await asyncio.sleep(0.01)
    in_flight = progress.snapshot()["requestsInFlight"]
    await asyncio.to_thread(server.kill)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(server.start)
    code, _ = await task
    return code, in_flight


def test_server_killed_with_requests_in_flight(tmp_path: Path, fault_model: Path) -> None:
    rng = random.Random(fault_seed("R3"))
    after_samples, down_s = rng.randint(5, 30), round(rng.uniform(0.3, 2.0), 2)
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(ROWS, words=25))
    server = RefServerProcess(fault_model, tmp_path / "dumps", free_port(), tmp_path / "server.log",
                              "--delay-ms", "100")
    server.start()
    try:
        clean = config(tmp_path, fault_model, dataset, server.url, "clean")
        assert run_once(clean) == EXIT_OK
        hit = config(tmp_path, fault_model, dataset, server.url, "hit")
        code, in_flight = asyncio.run(run_and_kill_server(hit, server, after_samples, down_s))
        print(f"killed the server after {after_samples} samples with {in_flight} requests in flight, down "
              f"{down_s} s; the run exited {code}")
        assert in_flight >= 2
        assert code in (EXIT_OK, EXIT_TRANSIENT)
        resumes = 0
        while code != EXIT_OK:
            resumes += 1
            assert resumes <= 2, "resume did not complete the run"
            code = run_once(hit)
        print(f"resumes needed: {resumes}")
    finally:
        server.stop()
    report = hsx_verify(str(tmp_path / "out" / "hit"))
    assert report["ok"] and report["manifest"] and report["samples"] == ROWS and report["duplicates"] == 0
    want, _ = stored(clean["output"], "clean")
    got, quarantined = stored(hit["output"], "hit")
    assert quarantined == {} and sorted(got) == sorted(want) == list(range(ROWS))
    for index, rec in got.items():
        ref = want[index]
        assert rec.sample_id == ref.sample_id
        assert np.array_equal(rec.input_ids, ref.input_ids), f"sample {index}: ids differ"
        assert np.array_equal(rec.aux_hidden_states, ref.aux_hidden_states), f"sample {index}: another dump"
        assert np.array_equal(rec.hidden_states, ref.hidden_states), f"sample {index}: another dump"
