"""Where rows come from: JSONL (plain, gzip, zstd) or Parquet, local or on S3, always streamed.

Each row carries its *line*: the 1-based line number in the (decompressed) file, blank lines
counted, so a quarantine entry points at the line a person opens; for Parquet, the 1-based row
number. Blank lines are not rows. Nothing here holds more than one chunk or one Parquet batch.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import xxhash

from hsx_extractor.storage.s3_client import S3Endpoint
from hsx_extractor.storage.uris import open_uri_chunks, open_uri_source

CHUNK = 8 << 20
PARQUET_BATCH_ROWS = 256
# Parquet rows decoded at once, by their row group's average size: a file of big rows holds ~this much.
PARQUET_BATCH_BYTES = 64 << 20
# The Parquet columns a row may use; others are never read.
PARQUET_COLUMNS = ("id", "messages", "conversations", "system", "tools", "input_ids", "loss_mask")
Kind = Literal["jsonl", "gzip", "zstd", "parquet"]


class DatasetError(RuntimeError):
    """The dataset as a whole cannot be read (missing file, unsupported URI, damaged compression)."""


@dataclass(frozen=True)
class OversizedRow:
    """A JSONL line longer than the reader's cap: read past, never held. Its digest is the xxh3-64 of
    its bytes without the trailing line break, as :func:`~hsx_extractor.run.plan.row_digest` of a line.
    A Parquet row past the cap (its Arrow bytes) is never decoded; its digest is of its size."""

    size: int
    digest: int


@dataclass(frozen=True)
class SourceRow:
    """One row as read: a JSONL line (bytes, without its newline), a decoded Parquet row, or only the
    size and digest of a line past the cap."""

    line: int
    data: bytes | dict[str, Any] | OversizedRow


def dataset_kind(uri: str) -> Kind:
    """The file's kind, from its name's suffix."""
    name = uri.rsplit("/", 1)[-1].lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".gz", ".gzip")):
        return "gzip"
    if name.endswith((".zst", ".zstd")):
        return "zstd"
    return "jsonl"


def _check_exists(uri: str) -> None:
    if not uri.startswith("s3://") and not Path(uri.removeprefix("file://")).is_file():
        raise DatasetError(f"dataset {uri} does not exist or is not a file")


def iter_rows(uri: str, where: S3Endpoint | None = None, max_line: int | None = None) -> Iterator[SourceRow]:
    """Every row of the dataset in file order, with its line number. A JSONL line longer than
    ``max_line`` bytes comes as an :class:`OversizedRow`: memory holds one chunk and at most
    ``max_line`` bytes of a line, however long the lines are."""
    _check_exists(uri)
    if dataset_kind(uri) == "parquet":
        yield from _parquet_rows(uri, where, max_line)
        return
    for number, line in enumerate(_raw_lines(uri, where, max_line), start=1):
        if isinstance(line, OversizedRow):
            yield SourceRow(number, line)
        elif line.strip():
            yield SourceRow(number, line.rstrip(b"\r\n"))


def _raw_lines(uri: str, where: S3Endpoint | None, max_line: int | None) -> Iterator[bytes | OversizedRow]:
    kind = dataset_kind(uri)
    if kind == "jsonl":
        chunks = iter(open_uri_chunks(uri, where, CHUNK))
        yield from split_lines(lambda _: next(chunks, b""), max_line)
        return
    compressed: Any = _ChunkStream(open_uri_chunks(uri, where, CHUNK))
    stream: Any
    if kind == "gzip":
        stream = gzip.GzipFile(fileobj=io.BufferedReader(compressed, CHUNK), mode="rb")
        damaged: tuple[type[Exception], ...] = (OSError, EOFError)
    else:
        import zstandard

        stream = zstandard.ZstdDecompressor().stream_reader(compressed, read_across_frames=True)
        damaged = (zstandard.ZstdError,)
    try:
        yield from split_lines(stream.read, max_line)
    except damaged as exc:
        raise DatasetError(f"dataset {uri}: cannot decompress ({kind}): {exc}") from exc
    finally:
        stream.close()


class _Skipped:
    """The digest and size of a line being read past (``rstrip(b"\\r\\n")`` semantics for the digest)."""

    def __init__(self, held: list[bytes]) -> None:
        self.hash = xxhash.xxh3_64()
        self.size = 0
        self.tail = b""  # a trailing run of line-break bytes, hashed only if more bytes follow
        for piece in held:
            self.add(piece)

    def add(self, piece: bytes) -> None:
        self.size += len(piece)
        data = self.tail + piece
        kept = data.rstrip(b"\r\n")
        self.hash.update(kept)
        self.tail = data[len(kept) :]

    def done(self) -> OversizedRow:
        return OversizedRow(self.size, self.hash.intdigest())


def split_lines(read: Callable[[int], bytes], max_line: int | None = None) -> Iterator[bytes | OversizedRow]:
    """Lines (each with its newline, the last maybe without) of a stream read in chunks; a line past
    ``max_line`` bytes is read past and comes as its :class:`OversizedRow`."""
    pending: list[bytes] = []
    held = 0
    skipped: _Skipped | None = None
    while chunk := read(CHUNK):
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start : end + 1] if end >= 0 else chunk[start:]
            if skipped is None and max_line is not None and held + len(piece) > max_line + 2:
                skipped = _Skipped(pending)  # +2: the line's own \r\n does not count
                pending, held = [], 0
            if skipped is not None:
                skipped.add(piece)
            elif piece:
                pending.append(piece)
                held += len(piece)
            if end < 0:
                break
            yield skipped.done() if skipped is not None else b"".join(pending)
            pending, held, skipped = [], 0, None
            start = end + 1
    if skipped is not None:
        yield skipped.done()
    elif pending:
        yield b"".join(pending)


class _ChunkStream(io.RawIOBase):
    """A readable stream over an iterator of byte chunks."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._current = b""
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._offset >= len(self._current):
            nxt = next(self._chunks, None)
            if nxt is None:
                return 0
            self._current, self._offset = nxt, 0
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._current) - self._offset)
        view[:n] = self._current[self._offset : self._offset + n]
        self._offset += n
        return n


class _RangedFile(io.RawIOBase):
    """A seekable, readable file over ranged reads of one object (what Parquet needs)."""

    def __init__(self, uri: str, where: S3Endpoint | None) -> None:
        self._source = open_uri_source(uri, where)
        self._size = self._source.size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._size - self._position)
        if n <= 0:
            return 0
        data = self._source.read_at(self._position, n)
        view[: len(data)] = data
        self._position += len(data)
        return len(data)


def _parquet_rows(uri: str, where: S3Endpoint | None, max_row: int | None) -> Iterator[SourceRow]:
    """Each row decoded to Python, or, past ``max_row`` bytes of Arrow data, only its size: a huge cell is
    never turned into Python objects (a list of ids would take ~9x its bytes). Its digest is of its size:
    such a row is quarantined for its size whatever it holds."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(f"dataset {uri}: reading Parquet needs pyarrow (the extractor extra)") from exc
    source: Any = (
        io.BufferedReader(_RangedFile(uri, where), CHUNK)
        if uri.startswith("s3://")
        else uri.removeprefix("file://")
    )
    try:
        parquet = pq.ParquetFile(source)
        columns = [c for c in parquet.schema_arrow.names if c in PARQUET_COLUMNS]
        number = 0
        for group in range(parquet.num_row_groups):
            meta = parquet.metadata.row_group(group)
            average = max(1.0, meta.total_byte_size / max(1, meta.num_rows))
            rows = max(1, min(PARQUET_BATCH_ROWS, int(PARQUET_BATCH_BYTES // average)))
            for batch in parquet.iter_batches(batch_size=rows, row_groups=[group], columns=columns):
                sizes = [batch.slice(i, 1).nbytes for i in range(batch.num_rows)]
                if max_row is None or max(sizes, default=0) <= max_row:
                    decoded = batch.to_pylist()
                else:
                    decoded = [None if size > max_row else batch.slice(i, 1).to_pylist()[0] for i, size in enumerate(sizes)]
                for row, size in zip(decoded, sizes, strict=True):
                    number += 1
                    yield SourceRow(number, OversizedRow(size, xxhash.xxh3_64_intdigest(b"parquet:%d" % size)) if row is None else row)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"dataset {uri}: cannot read it as Parquet: {exc}") from exc
