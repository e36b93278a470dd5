"""Long-running helper processes of the test ground, each logging to its own file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log file ('' when it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


SHM = Path("/dev/shm")
# What engines leave in /dev/shm when their process tree is killed: multiprocessing's named semaphores
# (spawn and forkserver start methods), SGLang's load-snapshot slots and its pid-stamped segments.
ENGINE_SHM_FILES = ("sem.mp-*", "sglang_loads_*", "sgl_shm_*")


def engine_shm_files() -> set[str]:
    """The names of such files in /dev/shm now."""
    return {p.name for pattern in ENGINE_SHM_FILES for p in SHM.glob(pattern)}


def _shm_inodes_in_use() -> set[int]:
    """Inodes of /dev/shm files some live process maps or has open (glibc maps a semaphore under a
    temporary name before linking it to its own, so the inode, not the name, identifies it)."""
    found: set[int] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                    found.add(int(fields[4]))
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).startswith(f"{SHM}/"):
                    found.add(fd.stat().st_ino)
        except OSError:  # gone, or not ours to read
            continue
    return found


def remove_orphaned_shm(before: set[str]) -> list[str]:
    """Remove the engine files of /dev/shm that appeared since ``before`` and no live process maps or has
    open: what a process tree killed with its resource tracker leaves (SGLang's shutdown kills its whole
    tree), which would otherwise outlive the test. Returns their names."""
    in_use = _shm_inodes_in_use()
    orphans = []
    for name in sorted(engine_shm_files() - before):
        try:
            if (SHM / name).stat().st_ino not in in_use:
                (SHM / name).unlink()
                orphans.append(name)
        except FileNotFoundError:
            pass
    return orphans


class ManagedProcess:
    """One component (etcd, kube-apiserver, ...) started in its own process group."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env,
                start_new_session=True,
            )

    @property
    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def describe_failure(self, what: str) -> str:
        return f"{self.name}: {what}\n--- last lines of {self.log_path} ---\n{tail(self.log_path)}"

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll `ready` until true; fail with the log tail when the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exit_code is not None:
                raise RuntimeError(self.describe_failure(f"exited with {self.exit_code} before {what}"))
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(self.describe_failure(f"not {what} after {timeout_s:.0f}s"))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL what is left after the grace period."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
