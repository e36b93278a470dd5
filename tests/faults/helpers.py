"""The fault suite's moving parts: the real reference server and the real ``hsx extract`` as
subprocesses that can be SIGKILLed and restarted, and readers of what a run stored."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.shard_format import SampleRecord
from hsx_extractor.storage.store import open_store

BIN = Path(sys.executable).parent
SEED_ENV = "HSX_FAULT_SEED"
HSX = str(BIN / "hsx")
LISTENING = "hsx reference server listening on "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RefServerProcess:
    """``hsx serve-reference`` on a fixed 127.0.0.1 port, so a restart comes back at the same URL."""

    def __init__(self, model: Path, dump_dir: Path, port: int, log: Path, *extra: str) -> None:
        self.model, self.dump_dir, self.port, self.log, self.extra = model, dump_dir, port, log, extra
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        cmd = [HSX, "serve-reference", "--model", str(self.model), "--dump-dir", str(self.dump_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1", *self.extra]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"reference server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"reference server not healthy after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/hsx_test/stats", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def kill(self) -> None:
        """SIGKILL, like an OOM-killed or crashed server: no cleanup at all."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def extract_command(config: Path) -> list[str]:
    return [HSX, "extract", "--config", str(config)]


def start_extract(config: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(extract_command(config), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)


def sigkill(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGKILL the process group; returns the exit code if it had already exited by itself."""
    code = proc.poll()
    if code is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return None
    return code


def hsx_verify(run_uri: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``hsx verify --json``; asserts it exits 0 and returns its report."""
    done = subprocess.run([HSX, "verify", "--json", run_uri], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def stored(output: dict[str, Any], run_id: str) -> tuple[dict[int, SampleRecord], dict[int, str]]:
    """Every stored sample and quarantine reason of a run; fails if an index appears twice."""
    store = open_store(OutputSpec.model_validate(output), run_id)
    samples: dict[int, SampleRecord] = {}
    quarantined: dict[int, str] = {}
    for k in sorted(store.committed_shards()):
        commit = store.get_commit(k)
        assert commit is not None
        header = store.read_header(k)
        for entry in header.samples:
            assert entry.index not in samples and entry.index not in quarantined, f"sample {entry.index} twice"
            samples[entry.index] = store.read_sample(k, header, entry)
        for q in commit.quarantine:
            assert q.index not in quarantined and q.index not in samples, f"row {q.index} twice"
            quarantined[q.index] = q.reason
    return samples, quarantined


def committed_by(log: str) -> list[int]:
    """The shards the last ``hsx extract`` in ``log`` committed or adopted ('this process committed shards')."""
    found = re.findall(r"this process committed shards \[([0-9, ]*)\]", log)
    return [int(k) for k in found[-1].split(",") if k.strip()] if found else []


def committed_count(output: dict[str, Any], run_id: str) -> int:
    return len(open_store(OutputSpec.model_validate(output), run_id).committed_shards())


def fault_seed(test: str) -> int:
    """A new seed each run (so runs explore new kill points), or ``$HSX_FAULT_SEED`` to replay one.
    Printed, so a failing run's captured output names the seed that reproduces it."""
    given = os.environ.get(SEED_ENV)
    seed = int(given) if given else secrets.randbits(32)
    print(f"{test} seed {seed} (replay: {SEED_ENV}={seed} pytest ...)", flush=True)
    return seed
