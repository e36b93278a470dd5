"""Device-to-host staging and the background dump writers.

The scheduler thread only enqueues copies: :func:`stage` starts a non-blocking copy of a GPU
tensor into pinned host memory and records a CUDA event; a writer thread waits for that event,
views the rows as bf16 bits and writes the dump through the protocol module. CPU tensors
(overlap scheduling already moved them, or tests) are kept by reference.

Writers never run torch ops: a torch op in a writer thread starts its own OpenMP team, which
competes with the scheduler's forward on CPU; numpy views, copies and file writes release the GIL,
so several writers scale with cores.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hsx_extractor import protocol

log = logging.getLogger("hsx.sglang_hook")

DEFAULT_QUEUE_SIZE = 64
# Measured in bench/hook_writer.py: writing is memory copies, so a few threads carry the dumps of
# a saturated 8-GPU server; more only add contention.
DEFAULT_WRITER_THREADS = 4


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


def bf16_bits(chunks: Sequence[Staged]) -> list[np.ndarray]:
    """The rows of ``chunks``, in order, as bf16 bit patterns (one array per chunk, no join:
    the protocol writes the pieces one after another)."""
    return [_bits(c.wait()) for c in chunks]


def _bits(rows: torch.Tensor) -> np.ndarray:
    if rows.dtype == torch.bfloat16:
        return np.ascontiguousarray(rows.view(torch.int16).numpy().view(np.uint16))
    return protocol.f32_to_bf16_bits(rows.numpy().astype(np.float32, copy=False))


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
    """Writer threads taking jobs from one bounded queue.

    A full queue blocks :meth:`submit`: the scheduler slows down rather than holding an
    unbounded number of requests' hidden states in host memory. Each job is one rid's whole
    file, so jobs need no order among themselves.
    """

    def __init__(
        self, dump_dir: str | Path, max_queue: int = DEFAULT_QUEUE_SIZE, threads: int = DEFAULT_WRITER_THREADS
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.dump_dir = protocol.make_dump_dir(dump_dir)
        self._queue: queue.Queue[tuple[int, DumpJob | ErrorJob]] = queue.Queue(maxsize=max_queue)
        self._state = threading.Condition()
        self._submitted = 0
        self._unfinished: set[int] = set()  # sequence numbers submitted and not yet written
        self.written = 0
        self.failed = 0
        self._threads = [
            threading.Thread(target=self._loop, name=f"hsx-dump-writer-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: DumpJob | ErrorJob) -> None:
        if not any(t.is_alive() for t in self._threads):
            raise RuntimeError("hsx dump writer threads are not running")
        with self._state:
            self._submitted += 1
            seq = self._submitted
            self._unfinished.add(seq)
        try:
            self._queue.put_nowait((seq, job))
        except queue.Full:
            log.warning(
                "hsx: dump queue full (%d jobs); the scheduler waits for the writers", self._queue.maxsize
            )
            self._queue.put((seq, job))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far is written; False on timeout."""
        with self._state:
            last = self._submitted
            return self._state.wait_for(lambda: not any(s <= last for s in self._unfinished), timeout)

    def _loop(self) -> None:
        while True:
            seq, job = self._queue.get()
            ok = True
            try:
                run_job(self.dump_dir, job)
            except Exception:
                # Even the error marker failed (disk full, directory gone): log and go on.
                ok = False
                log.exception("hsx: could not write anything for %s", job_rid(job))
            with self._state:
                self._unfinished.discard(seq)
                if ok:
                    self.written += 1
                else:
                    self.failed += 1
                self._state.notify_all()
