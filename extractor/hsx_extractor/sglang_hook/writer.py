"""Device-to-host staging and the background dump writer.

The scheduler thread only enqueues copies: :func:`stage` starts a non-blocking copy of a GPU
tensor into pinned host memory and records a CUDA event; the writer thread waits for that
event, turns the rows into bf16 bits and writes the dump through the protocol module. CPU
tensors (overlap scheduling already moved them, or tests) are kept by reference.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hsx_extractor import protocol

log = logging.getLogger("hsx.sglang_hook")

DEFAULT_QUEUE_SIZE = 64


@dataclass
class Staged:
    """Rows on their way to host memory."""

    host: torch.Tensor
    # Set when a device copy is in flight; the writer waits for it before reading ``host``.
    event: torch.cuda.Event | None = None
    # Keeps the device rows alive until the copy is done, so the allocator cannot reuse them.
    source: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.host.shape[0])

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
            self.source = None
        return self.host


def stage(rows: torch.Tensor) -> Staged:
    """Start moving ``rows`` to host memory without blocking the caller."""
    if rows.device.type == "cpu":
        return Staged(host=rows)
    stream = torch.cuda.current_stream(rows.device)
    host = torch.empty(rows.shape, dtype=rows.dtype, device="cpu", pin_memory=True)
    host.copy_(rows, non_blocking=True)
    # The rows were made on SGLang's forward stream: tell the allocator this stream reads them too.
    rows.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    return Staged(host=host, event=event, source=rows)


def bf16_bits(chunks: Sequence[Staged]) -> np.ndarray:
    """The rows of ``chunks``, in order, as one C-ordered array of bf16 bit patterns."""
    parts = [c.wait() for c in chunks]
    rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16)
    return rows.contiguous().view(torch.int16).numpy()


@dataclass
class DumpJob:
    """One request's complete dump: ids it ran plus staged aux and final rows."""

    meta: protocol.DumpMeta
    input_ids: np.ndarray
    aux: list[Staged]
    final: list[Staged]


@dataclass
class ErrorJob:
    """An error marker for one rid."""

    rid: str
    reason: str
    message: str


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


def job_rid(job: DumpJob | ErrorJob) -> str:
    return job.rid if isinstance(job, ErrorJob) else job.meta.rid


def run_job(dump_dir: Path, job: DumpJob | ErrorJob) -> Path:
    """Write one job's file. A dump that cannot be written becomes an error marker, never data."""
    if isinstance(job, ErrorJob):
        return protocol.write_error(dump_dir, job.rid, job.reason, job.message)
    try:
        return protocol.write_dump(
            dump_dir, job.meta, job.input_ids, bf16_bits(job.aux), bf16_bits(job.final)
        )
    except Exception as exc:
        log.exception("hsx: writing the dump of %s failed", job.meta.rid)
        return protocol.write_error(dump_dir, job.meta.rid, "writer_error", f"{type(exc).__name__}: {exc}")


class DumpWriter:
    """A background thread writing jobs from a bounded queue.

    A full queue blocks :meth:`submit`: the scheduler slows down rather than holding an
    unbounded number of requests' hidden states in host memory.
    """

    def __init__(self, dump_dir: str | Path, max_queue: int = DEFAULT_QUEUE_SIZE) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue[DumpJob | ErrorJob | _Stop] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="hsx-dump-writer", daemon=True)
        self._thread.start()
        self.written = 0
        self.failed = 0

    def submit(self, job: DumpJob | ErrorJob) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("hsx dump writer thread is not running")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            log.warning(
                "hsx: dump queue full (%d jobs); the scheduler waits for the writer", self._queue.maxsize
            )
            self._queue.put(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far is written; False on timeout."""
        stop = _Stop()
        self._queue.put(stop)
        return stop.done.wait(timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if isinstance(job, _Stop):
                job.done.set()
                continue
            try:
                run_job(self.dump_dir, job)
                self.written += 1
            except Exception:
                # Even the error marker failed (disk full, directory gone): log and go on.
                self.failed += 1
                log.exception("hsx: could not write anything for %s", job_rid(job))
