"""Helpers shared by the extractor tests (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Clock:
    """A clock the test moves (``clock.now += 5``), for code that takes its time source as an argument."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class RefServer:
    url: str
    dump_dir: Path
    model: Path

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def set_fault(
        self, kind: str | None = None, every: int = 1, first_attempt_only: bool = False, delay_ms: float = 0
    ) -> None:
        self._post(
            "/hsx_test/fault",
            {"kind": kind, "every": every, "firstAttemptOnly": first_attempt_only, "delayMs": delay_ms},
        )

    def stats(self) -> dict[str, Any]:
        return self.get("/hsx_test/stats")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until requests of an earlier, stopped run have drained (they would skew the stats)."""
        deadline = time.monotonic() + timeout
        while self.stats()["inFlight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.stats()["inFlight"] == 0, "reference server still busy"


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat_rows(n: int, words: int = 12, prefix: str = "s") -> list[dict[str, Any]]:
    """``n`` distinct, well-formed conversations of roughly ``words`` words per turn."""
    vocab = ["alpha", "beta", "gamma", "delta", "capital", "plus", "times", "code", "tests", "small"]
    rows = []
    for i in range(n):
        user = " ".join(vocab[(i + k) % len(vocab)] for k in range(words))
        answer = " ".join(vocab[(i * 3 + k) % len(vocab)] for k in range(words)) + f" {i}."
        rows.append(
            {
                "id": f"{prefix}{i}",
                "messages": [
                    {"role": "user", "content": f"Question {i}: {user}?"},
                    {"role": "assistant", "content": answer},
                ],
            }
        )
    return rows


def base_config(
    tmp_path: Path, server: RefServer, dataset: Path, run_id: str = "run", **over: Any
) -> dict[str, Any]:
    """An ExtractConfig dict for one in-process run against the session server."""
    cfg: dict[str, Any] = {
        "runId": run_id,
        "dataset": {"uri": str(dataset), "maxLength": 512},
        "output": {"uri": str(tmp_path / "out"), "shardTargetBytes": 1 << 20},
        "modelPath": str(server.model),
        "serverUrl": server.url,
        "dumpDir": str(server.dump_dir),
        "concurrency": 4,
        "progressPort": 0,
        "logIntervalSeconds": 60,
        "validation": {"dumpTimeoutSeconds": 5, "maxRetries": 1, "maxMismatchRate": 1.0},
    }
    for dotted, value in over.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg
