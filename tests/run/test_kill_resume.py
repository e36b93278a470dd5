"""SIGKILL the extractor (a real `hsx extract` subprocess) at several points, SIGTERM it once,
restart it, and check that the verified output holds every good sample exactly once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from hsx_extractor.contract import EXIT_OK, EXIT_TRANSIENT
from hsx_extractor.run.tokens import ChatTokenizer

from .helpers import RefServer, base_config, chat_rows, write_jsonl
from .test_pipeline import expected_tokens, stored, verified

Progress = dict[str, Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(config: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "hsx_extractor.tools.cli", "extract", "--config", str(config)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def poll(port: int) -> Progress | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=2) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except OSError:
        return None


def kill_when(
    proc: subprocess.Popen[bytes], port: int, condition: Callable[[Progress], bool], sig: int = signal.SIGKILL
) -> Progress:
    """Signal ``proc`` as soon as its /progress satisfies ``condition``; the signal must land."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"extractor ended before the kill point: {proc.stderr.read()!r}"  # type: ignore[union-attr]
        seen = poll(port)
        if seen is not None and condition(seen):
            os.kill(proc.pid, sig)
            # SIGTERM (eviction) is a clean, retryable stop: exit code EXIT_TRANSIENT.
            assert proc.wait(60) == (-signal.SIGKILL if sig == signal.SIGKILL else EXIT_TRANSIENT)
            return seen
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("kill point never reached")


def test_sigkill_at_several_points_then_resume(
    tmp_path: Path, ref_server: RefServer, tokenizer: ChatTokenizer
) -> None:
    rows: list[Any] = chat_rows(90, words=30)
    rows[17] = '{"id": "torn'  # bad rows must come out quarantined exactly once too
    rows[55] = {"id": "s54", "messages": rows[55]["messages"]}  # duplicate of row 54's id
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    port = free_port()
    cfg = base_config(
        tmp_path,
        ref_server,
        dataset,
        run_id="killed",
        concurrency=3,
        progressPort=port,
        progressHost="127.0.0.1",
        logIntervalSeconds=0.5,
    )
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    ref_server.set_fault(None, delay_ms=25)

    kill_points: list[tuple[str, Callable[[Progress], bool]]] = [
        ("as soon as /progress answers", lambda p: True),
        (
            "mid first shard",
            lambda p: p["state"] == "running" and p["samplesDone"] >= 3 and p["shardsCommitted"] == 0,
        ),
        (
            "right after a commit",
            lambda p: p["shardsCommitted"] >= 1 and p["samplesDone"] > p["shardsCommitted"],
        ),
        ("later, mid shard", lambda p: p["shardsCommitted"] >= 2 and p["samplesDone"] % 7 == 3),
    ]
    seen = []
    for name, condition in kill_points:
        at = kill_when(start(config), port, condition)
        seen.append((name, at["samplesDone"], at["shardsCommitted"]))
    at = kill_when(
        start(config), port, lambda p: p["state"] == "running" and p["samplesDone"] >= 45, signal.SIGTERM
    )
    seen.append(("SIGTERM", at["samplesDone"], at["shardsCommitted"]))
    plan = json.loads((tmp_path / "out" / "killed" / "plan.json").read_text())
    assert len(plan["shards"]) >= 4, plan
    committed_before = {p.name for p in (tmp_path / "out" / "killed" / "commits").iterdir()}
    assert 0 < len(committed_before) < len(plan["shards"]), seen

    final = start(config)
    assert final.wait(300) == EXIT_OK, final.stderr.read()  # type: ignore[union-attr]

    samples, quarantined = stored(cfg)
    want = expected_tokens(tokenizer, dataset, 512)
    assert quarantined == {17: "invalid_json", 55: "duplicate_id"}
    assert sorted(samples) == sorted(set(want) - {55}) and len(samples) == 88
    for index, rec in samples.items():
        assert rec.input_ids.tolist() == want[index].input_ids.tolist()
    report = verified(cfg)
    assert report["samples"] == 88 and report["duplicates"] == 0 and report["quarantined"] == 2
    # Token counts ride in the commit records: each shard's counted once, however often it was begun.
    masked = Counter(t for i in samples for t, m in zip(want[i].input_ids.tolist(), want[i].loss_mask.tolist(), strict=True) if m)
    counts = json.loads((tmp_path / "out" / "killed" / "manifest.json").read_text())["tokenCounts"]
    assert dict(zip(counts["ids"], counts["counts"], strict=True)) == masked
    # Killed processes' dumps were cleaned up by the restart; the final run consumed its own.
    assert not [p for p in ref_server.dump_dir.iterdir() if p.name.startswith("hsx-killed-")]
    print("kill points (name, samplesDone, shardsCommitted):", seen)
