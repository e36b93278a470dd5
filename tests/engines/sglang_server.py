"""One real SGLang server process on CPU, launched the way the operator launches it.

The argv is ``hsx_extractor.sglang_hook.launch.server_args(...)`` (the operator's launcher) with
``python3`` replaced by the SGLang venv's python and the CPU flags below as extra args; the
environment is ``server_env(...)`` plus ``SGLANG_USE_CPU_ENGINE=1``. Used by tests/engines and
bench/engines.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx_extractor import protocol
from hsx_extractor.sglang_hook.launch import server_args, server_env
from tests.engines.sglang_venv import process_env, venv_python
from tests.ground.procs import engine_shm_files, remove_orphaned_shm

# What SGLang needs to serve a tiny model on CPU. Overlap scheduling stays on, as in production
# (the operator does not turn it off): the hook then gets each batch's results one step late.
# --sleep-on-idle: without it an idle CPU scheduler spins a whole core, which a 2-core machine
# cannot spare while the extractor and the tests run.
CPU_ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--dtype", "float32",
    "--mem-fraction-static", "0.5",
    "--context-length", "512",
    "--max-total-tokens", "4096",
    "--sleep-on-idle",
)  # fmt: skip
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
START_TIMEOUT_S = 420.0
# The hook logs this line in every process it patches (bootstrap.patch_module).
PATCHED_LINE = "hsx: patched SchedulerBatchResultProcessor._append_prefill_hidden_states"


# Every server started in this process, so a test can read all their stand-in logs at the end.
STARTED: list[SGLangServer] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SGLangServer:
    """``start()`` it, use ``url``, ``stop()`` or ``kill()`` it; ``start()`` again restarts it."""

    engine = "sglang"  # ExtractConfig.engine
    engine_name = "SGLang"  # in error messages (vllm_server.VLLMServer reuses the lifecycle)

    model: Path
    hsx_dir: Path  # this checkout's hsx, installed from its wheel (sglang_venv.install_hsx)
    work: Path  # log, stand-in call log and (by default) the dump directory go here
    dump_dir: Path | None = None  # None: work/dumps; ``hook=False`` starts without one
    hook: bool = True
    chunked_prefill_size: int = -1
    layer_ids: list[int] | None = None
    extra_args: tuple[str, ...] = ()
    final_state: str = protocol.FINAL_POST_NORM  # pre-norm: the hook keeps the final norm's input
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    start_seconds: list[float] = field(default_factory=list)
    shm_before: set[str] = field(default_factory=set)  # /dev/shm's engine files at start (remove_orphaned_shm)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        if self.hook and self.dump_dir is None:
            self.dump_dir = self.work / "dumps"
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def standin_log(self) -> Path:
        return self.work / "sgl_kernel_standin.log"

    def log_path(self, start: int | None = None) -> Path:
        return self.work / f"server-{self.starts if start is None else start}.log"

    def argv(self) -> list[str]:
        argv = server_args(
            str(self.model),
            1,
            self.port,
            self.layer_ids,
            [*CPU_ARGS, *self.extra_args],
            chunked_prefill_size=self.chunked_prefill_size,
        )
        if argv[0] != "python3":
            raise AssertionError(f"server_args no longer starts with python3: {argv[:3]}")
        return [str(venv_python()), *argv[1:]]

    def env(self) -> dict[str, str]:
        extra = dict(CPU_ENV)
        if self.hook:
            assert self.dump_dir is not None
            extra.update(server_env(str(self.dump_dir), final_state=self.final_state))
        env = process_env(self.hsx_dir, extra, self.standin_log)
        if not self.hook:
            env.pop("SGLANG_HS_DUMP_DIR", None)
        return env

    def start(self, timeout: float = START_TIMEOUT_S) -> SGLangServer:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("server already running")
        self.starts += 1
        if not any(s is self for s in STARTED):
            STARTED.append(self)
        t0 = time.monotonic()
        self.shm_before = engine_shm_files()
        with open(self.log_path(), "wb") as log:
            # Its own process group: stop() and kill() reach the scheduler and detokenizer too.
            self.proc = subprocess.Popen(
                self.argv(), env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=self.work,
            )  # fmt: skip
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.engine_name} exited with {self.proc.returncode} during start:\n{self.log_tail()}"
                )
            if self.healthy():
                break
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.engine_name} not healthy after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(1.0)
        self.start_seconds.append(time.monotonic() - t0)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.healthy()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def log_text(self, start: int | None = None) -> str:
        path = self.log_path(start)
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _wait_group_gone(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False

    def kill(self) -> None:
        """SIGKILL the whole server (launcher, scheduler, detokenizer) at once."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        self._wait_group_gone(30)
        remove_orphaned_shm(self.shm_before)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after 20 s."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self._signal_group(signal.SIGTERM)
        if not self._wait_group_gone(20):
            self._signal_group(signal.SIGKILL)
            self._wait_group_gone(30)
        self.proc.wait()
        remove_orphaned_shm(self.shm_before)

    def generate(self, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def standin_calls(self) -> list[str]:
        """Lines the sgl_kernel stand-in logged for calls of its functions (must stay empty)."""
        if not self.standin_log.exists():
            return []
        return [ln for ln in self.standin_log.read_text().splitlines() if ln.startswith("call ")]

    def standin_accesses(self) -> list[str]:
        if not self.standin_log.exists():
            return []
        return [ln for ln in self.standin_log.read_text().splitlines() if ln.startswith("access ")]

    def prefill_batch_sizes(self) -> list[int]:
        """``#new-seq`` of every prefill batch SGLang logged, over all starts."""
        sizes: list[int] = []
        for start in range(1, self.starts + 1):
            sizes += [int(m) for m in re.findall(r"Prefill batch, #new-seq: (\d+)", self.log_text(start))]
        return sizes
