"""Spool files: where a shard's encoded samples wait until it is sealed, and the uploadable view of
one (a header plus ordered regions of the file, read without joining them)."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpooledObject:
    """An object made of a header and ordered regions of a spool file (no copy is made)."""

    header: bytes
    fd: int
    regions: tuple[tuple[int, int], ...]  # (spool offset, length) in object order

    @property
    def size(self) -> int:
        return len(self.header) + sum(n for _, n in self.regions)

    def read_at(self, offset: int, length: int, into: bytearray | None = None) -> bytearray:
        """``length`` bytes from ``offset``, copied once from the spool's pages into ``into`` (reused, its
        pages already faulted in; it must be exactly ``length`` long) or a new buffer."""
        if into is not None and len(into) != length:
            raise ValueError(f"buffer of {len(into)} bytes for a read of {length}")
        out = into if into is not None else bytearray(length)
        view = memoryview(out)
        end = offset + length
        for seg_start, seg_len, spool_off in self._segments():
            lo, hi = max(offset, seg_start), min(end, seg_start + seg_len)
            if lo < hi:
                dest = view[lo - offset : hi - offset]
                if spool_off is None:
                    dest[:] = self.header[lo - seg_start : hi - seg_start]
                else:
                    pread_into(self.fd, dest, spool_off + lo - seg_start)
            if seg_start + seg_len >= end:
                break
        return out

    def _segments(self) -> Iterator[tuple[int, int, int | None]]:
        yield 0, len(self.header), None
        pos = len(self.header)
        for spool_off, n in self.regions:
            yield pos, n, spool_off
            pos += n


def pwrite_all(fd: int, parts: Sequence[bytes | memoryview], offset: int) -> None:
    """Write buffers back to back at ``offset`` without joining them first."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    while views:
        written = os.pwritev(fd, views, offset)
        if written <= 0:
            raise OSError(f"spool file write made no progress at offset {offset}")
        offset += written
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def pread_into(fd: int, dest: memoryview, offset: int) -> None:
    while dest.nbytes:
        n = os.preadv(fd, [dest], offset)
        if n <= 0:
            raise OSError(f"spool file short read: {dest.nbytes} bytes missing at {offset}")
        dest, offset = dest[n:], offset + n


class SpoolFiles:
    """Anonymous spool files, reused from shard to shard.

    A reused file's pages are already in the page cache, so filling it again is a plain copy;
    fresh pages cost a page fault each, and on VMs that return freed memory to their host, a
    host fault as well (writing fresh page cache ran at ~70 MB/s on the benchmark machine,
    rewriting the same file at ~9 GB/s). At most ``keep`` idle files are held.
    """

    def __init__(self, directory: str | None, keep: int = 2):
        self._directory = directory
        self._keep = keep
        self._idle: list[int] = []
        self._closed = False
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        fd, path = tempfile.mkstemp(prefix="hsx-shard-", suffix=".spool", dir=self._directory)
        os.unlink(path)  # anonymous: a killed process leaves nothing behind
        return fd

    def give_back(self, fd: int) -> None:
        with self._lock:
            # A builder aborted after the run closed the store must not park its file here.
            if not self._closed and len(self._idle) < self._keep:
                self._idle.append(fd)
                return
        os.close(fd)

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for fd in idle:
            os.close(fd)
