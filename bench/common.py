"""What the benchmarks share: the synthetic server subprocess, datasets, S3, timing, profiles, results."""

from __future__ import annotations

import contextlib
import cProfile
import json
import os
import platform
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BYTES_PER_BF16 = 2


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2, default=str) + "\n")
    return path


def scratch(prefix: str, shm: bool = False) -> Path:
    """A fresh directory (in /dev/shm when ``shm``, like the pod's dump volume)."""
    base = "/dev/shm" if shm and Path("/dev/shm").is_dir() else None
    return Path(tempfile.mkdtemp(prefix=f"hsx-bench-{prefix}-", dir=base))


@dataclass(frozen=True)
class Synth:
    url: str
    dump_dir: Path
    proc: subprocess.Popen[str]

    def stats(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/bench/stats", timeout=30) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def reset(self) -> None:
        import urllib.request

        req = urllib.request.Request(f"{self.url}/bench/reset", b"{}", method="POST")
        urllib.request.urlopen(req, timeout=30).read()


@contextlib.contextmanager
def synth_server(dump_dir: Path, hidden: int, pool_rows: int, *extra: str) -> Iterator[Synth]:
    """``python -m bench.synth_server`` on a free 127.0.0.1 port; stopped on exit."""
    from bench.synth_server import LISTENING

    cmd = [sys.executable, "-m", "bench.synth_server", "--dump-dir", str(dump_dir), "--hidden", str(hidden),
           "--pool-rows", str(pool_rows), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        seen = []
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("synthetic server exited during start:\n" + "".join(seen))
            seen.append(line)
            if line.startswith(LISTENING):
                break
        # Drain its output so a chatty server never blocks on a full pipe.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield Synth(line[len(LISTENING):].strip(), dump_dir, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class TlsFiles:
    """A serving certificate for 127.0.0.1, its key, and the CA that signed it (what a client trusts)."""

    cert: Path
    key: Path
    ca: Path


def tls_files(directory: Path) -> TlsFiles:
    """Made with the test ground's throwaway CA (tests/ground/pki.py)."""
    from tests.ground.pki import CertificateAuthority

    ca = CertificateAuthority("hsx-bench-ca")
    pair = ca.issue("127.0.0.1", ip_addresses=["127.0.0.1"], server=True)
    files = TlsFiles(directory / "cert.pem", directory / "key.pem", directory / "ca.pem")
    files.cert.write_bytes(pair.cert_pem)
    files.key.write_bytes(pair.key_pem)
    files.ca.write_bytes(ca.cert_pem)
    return files


@contextlib.contextmanager
def null_sink(tls: TlsFiles | None = None, slow_shards: float = 0.0) -> Iterator[str]:
    """``python -m bench.null_s3`` on a free 127.0.0.1 port (its endpoint URL); stopped on exit.
    With ``tls`` it serves HTTPS; ``slow_shards``: each PUT of a shard's bytes waits that many seconds."""
    cmd = [sys.executable, "-m", "bench.null_s3", "--slow-shards", str(slow_shards)]
    if tls is not None:
        cmd += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening "):
            raise RuntimeError(f"null sink did not start: {line!r}")
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def tokenizer_dir(root: Path) -> Path:
    """The tiny model's locally trained tokenizer (the benchmarks send pre-tokenized rows)."""
    from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tokenizer

    out = root / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, TinyModelSpec().vocab_size)
    return out


def token_rows(path: Path, lengths: list[int], seed: int, vocab: int = 500) -> Path:
    """A pre-tokenized JSONL dataset ({"id", "input_ids", "loss_mask"}) with the given lengths, for the tiny
    tokenizer of :func:`tokenizer_dir`: each row starts with its BOS, as the chat template writes it (a row
    without is quarantined `bos_mismatch`), and holds no other special token."""
    from hsx_extractor.tools.tinymodel import BOS, SPECIAL_TOKENS

    bos = SPECIAL_TOKENS.index(BOS)  # the tiny tokenizer's ids start with its special tokens, in order
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for i, n in enumerate(lengths):
            ids = [bos, *rng.integers(len(SPECIAL_TOKENS), vocab, n - 1).tolist()]
            mask = (rng.random(n) < 0.5).astype(int).tolist()
            mask[-1] = 1
            f.write(json.dumps({"id": f"b{i}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def raw_bytes(lengths: list[int], hidden: int, num_aux: int) -> int:
    """Bytes of hidden states (aux + final, bf16) for these sample lengths."""
    return sum(lengths) * (num_aux + 1) * hidden * BYTES_PER_BF16


def cpu_seconds() -> float:
    """CPU time of this process, all threads, user + system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class ThreadProfiles:
    """cProfile in every thread started while active (the extractor works in pools), merged at the end.
    Times are each thread's CPU time (``time.thread_time``): what a function costs, not what it waited."""

    def __init__(self) -> None:
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()
        self._main = cProfile.Profile(time.thread_time)

    def _start_in_thread(self, *_: Any) -> None:
        prof = cProfile.Profile(time.thread_time)
        with self._lock:
            self._profiles.append(prof)
        prof.enable()  # replaces this bootstrap hook in the new thread

    def __enter__(self) -> ThreadProfiles:
        threading.setprofile(self._start_in_thread)  # type: ignore[arg-type]
        self._main.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        self._main.disable()
        threading.setprofile(None)  # type: ignore[arg-type]

    def top(self, n: int = 15) -> list[dict[str, Any]]:
        """The ``n`` functions with the most own time, summed over threads (idle waits left out)."""
        stats = pstats.Stats(self._main)
        for prof in self._profiles:
            with contextlib.suppress(TypeError, ValueError):
                stats.add(prof)
        rows = []
        # Blocking waits are idle threads, not work.
        idle = ("acquire", "wait", "select", "poll", "sleep", "_worker", "'get' of '_queue")
        for (file, line, func), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
            if any(word in func for word in idle):
                continue
            rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": calls,
                         "own_s": round(own, 3), "cumulative_s": round(cum, 3)})
        rows.sort(key=lambda r: r["own_s"], reverse=True)
        return rows[:n]


class PeakSampler:
    """Samples a process's peak RSS (VmHWM) and a directory's bytes every ``interval`` seconds."""

    def __init__(self, pid: int, directory: Path | None = None, interval: float = 0.05) -> None:
        self.pid = pid
        self.directory = directory
        self.interval = interval
        self.peak_rss = 0
        self.peak_dir_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from hsx_extractor.run.collect import waiting_bytes

        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, read_hwm(self.pid))
            if self.directory is not None:
                self.peak_dir_bytes = max(self.peak_dir_bytes, waiting_bytes(self.directory))
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def read_hwm(pid: int) -> int:
    """Peak resident set size of ``pid`` in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(wall seconds, CPU seconds of this process, result)`` of ``fn()``."""
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, cpu_seconds() - cpu0, out


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def spool_files() -> dict[int, os.stat_result]:
    """This process's open shard spool files (``/proc/self/fd``): fd -> its stat."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "hsx-shard-" in os.readlink(f"/proc/self/fd/{fd}"):
                found[int(fd)] = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return found


class SpoolWatch:
    """The most spool files (and their bytes) this process held at once, polled every 10 ms: what a pod's /scratch
    holds. Files already open when the watch starts are not the run's (an earlier store may still hold one)."""

    def __init__(self) -> None:
        self.peak_files = 0
        self.peak_bytes = 0
        self.before = {(fd, st.st_ino) for fd, st in spool_files().items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            files, size = 0, 0
            for fd, st in spool_files().items():
                if (fd, st.st_ino) not in self.before:
                    files += 1
                    size += st.st_size
            self.peak_files, self.peak_bytes = max(self.peak_files, files), max(self.peak_bytes, size)
            self._stop.wait(0.01)

    def __enter__(self) -> SpoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
