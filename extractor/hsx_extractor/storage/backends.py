"""Storage backends of the store: errors, the two protocols, and the local-directory backend.

The S3 backend is in :mod:`hsx_extractor.storage.s3`. Keys are relative to the backend root and
already validated (:mod:`hsx_extractor.storage.layout`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from hsx_extractor.contract import EXIT_PERMANENT, EXIT_TRANSIENT
from hsx_extractor.storage.layout import InvalidKeyError
from hsx_extractor.storage.stored_json import ShardFormatError


class StoreError(Exception):
    """Base of storage failures. ``exit_code`` is what ``hsx extract`` should exit with."""

    exit_code = EXIT_TRANSIENT


class TransientStoreError(StoreError):
    """A retryable failure that persisted past the retry budget."""


class PermanentStoreError(StoreError):
    """Retrying cannot help: access denied, no such bucket, bad credentials, invalid key."""

    exit_code = EXIT_PERMANENT


class ObjectChanged(PermanentStoreError):
    """An object was rewritten while it was read (a ranged read pinned to its ETag answered 412)."""


class ShardConflictError(PermanentStoreError):
    """A different object already holds this shard's key. It is never overwritten."""


class ObjectSource(Protocol):
    """Bytes of an object to upload, readable at any offset from several threads."""

    @property
    def size(self) -> int: ...

    def read_at(self, offset: int, length: int, into: bytearray | None = None) -> bytes | bytearray:
        """``into``, when given, is a buffer of exactly ``length`` bytes to fill and return (reused)."""
        ...


def check_object_size(key: str, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise ShardFormatError(f"object {key} is {size} bytes, more than the {max_bytes} allowed for it")


class Backend(Protocol):
    """What the commit protocol needs from a store. Keys are relative to the store root."""

    description: str  # for messages: "s3://bucket" or a directory

    def get(self, key: str, max_bytes: int) -> bytes | None:
        """The whole object, None if absent; :class:`ShardFormatError` (before reading it) if it is
        larger than ``max_bytes``: only small JSON objects are read whole."""
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def get_range_into(self, key: str, start: int, into: memoryview) -> memoryview:
        """Like ``get_range`` for ``len(into)`` bytes, read into ``into`` (a buffer the caller reuses:
        no fresh pages per read); the part of it that was filled."""
        ...

    def size(self, key: str) -> int | None: ...

    def put_if_absent(self, key: str, data: bytes) -> bool: ...

    def upload_if_absent(self, key: str, source: ObjectSource, metadata: dict[str, str]) -> bool: ...

    def list_keys(self, prefix: str) -> Iterator[str]: ...

    def iter_object(self, key: str, chunk_size: int) -> Iterator[bytes]: ...

    def abort_uploads(self, prefix: str) -> int: ...

    def delete(self, key: str) -> None: ...


class LocalBackend:
    """A directory as a store. Create-if-absent is ``link()`` of a complete temp file: atomic."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).absolute()
        self.description = str(self.root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise InvalidKeyError(f"key {key!r} escapes {self.root}")
        return path

    def get(self, key: str, max_bytes: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                check_object_size(key, size, max_bytes)
                return f.read(size)  # read(n) allocates n first: ask for what the file holds
        except FileNotFoundError:
            return None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with open(self._path(key), "rb") as f:
            # What exists, like S3: read(length) would first allocate ``length`` bytes, whatever
            # the file holds (a damaged index asking for 2**36 bytes of a small file).
            length = max(0, min(length, os.fstat(f.fileno()).st_size - start))
            f.seek(start)
            return f.read(length)

    def get_range_into(self, key: str, start: int, into: memoryview) -> memoryview:
        got = 0
        with open(self._path(key), "rb") as f:
            while got < len(into):
                n = os.preadv(f.fileno(), [into[got:]], start + got)
                if n <= 0:
                    break  # what exists, like S3
                got += n
        return into[:got]

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def _create(self, key: str, chunks: Iterable[bytes | bytearray]) -> bool:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            return True
        finally:
            os.unlink(tmp)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._create(key, [data])

    def upload_if_absent(self, key: str, source: ObjectSource, metadata: dict[str, str]) -> bool:
        step = 8 << 20
        return self._create(
            key, (source.read_at(o, min(step, source.size - o)) for o in range(0, source.size, step))
        )

    def list_keys(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix.rstrip("/")) if prefix.rstrip("/") else self.root
        if not base.is_dir():
            return
        for path in sorted(base.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                yield path.relative_to(self.root).as_posix()

    def iter_object(self, key: str, chunk_size: int) -> Iterator[bytes]:
        with open(self._path(key), "rb") as f:
            while chunk := f.read(chunk_size):
                yield chunk

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def probe_writable(self, prefix: str) -> None:
        """Fail at once, naming the fix, when this process cannot create files under ``prefix``.

        In a pod the output directory is a hostPath the kubelet makes as root, 0755, whatever the
        pod's fsGroup: the extractor's user cannot write there unless the node's admin made it so."""
        directory = self._path(prefix)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".hsx-probe-"):
                pass
        except OSError as exc:
            uid, gid = os.getuid(), os.getgid()
            raise PermanentStoreError(
                f"output directory {directory} is not writable by this process (uid {uid}, gid {gid}): "
                f"{exc.strerror}; on the node, make the output directory writable by that user "
                f"(install -d -o {uid} -g {gid} DIR), or use an s3:// output"
            ) from exc

    def abort_uploads(self, prefix: str) -> int:
        # Temp files of writers killed mid-write; a live writer's temp file vanishes on link anyway.
        path = self._path(prefix)
        directory, stem = (path, "") if prefix.endswith("/") else (path.parent, path.name)
        count = 0
        if directory.is_dir():
            for tmp in directory.glob(f".{stem}*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                    count += 1
        return count
