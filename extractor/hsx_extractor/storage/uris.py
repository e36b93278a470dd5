"""URIs to storage: the backend of an output URI, and reading inputs that are not a run's own
objects (a dataset file or object, local or ``s3://``, as lines, chunks, random access (Parquet)
or a stat that tells whether it was rewritten)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.backends import Backend, LocalBackend, ObjectSource, PermanentStoreError
from hsx_extractor.storage.layout import parse_output_uri
from hsx_extractor.storage.s3_client import S3Endpoint


def open_backend(uri: str, output: OutputSpec | None = None) -> tuple[Backend, str]:
    """The backend for an output URI and the key prefix inside it."""
    location = parse_output_uri(uri)
    if location.bucket is None:
        return LocalBackend(location.prefix), ""
    from hsx_extractor.storage.s3 import S3Backend

    return S3Backend.from_output(
        location.bucket, output or OutputSpec.model_validate({"uri": uri})
    ), location.prefix


def _s3_object(uri: str, where: S3Endpoint | None) -> tuple[Any, str]:
    from hsx_extractor.storage.s3 import S3Backend, split_object_uri
    from hsx_extractor.storage.s3_client import S3Endpoint, S3TransferConfig, make_client

    bucket, key = split_object_uri(uri)
    config = S3TransferConfig()
    client = make_client(where or S3Endpoint(), config)
    return S3Backend(client, bucket, config, ""), key


def _local_path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def uri_stat(uri: str, where: S3Endpoint | None = None) -> dict[str, Any]:
    """What changes when a file or object is rewritten: size and ETag (S3) or size and mtime (local)."""
    if uri.startswith("s3://"):
        backend, key = _s3_object(uri, where)
        return backend.stat(key)  # type: ignore[no-any-return]
    st = os.stat(_local_path(uri))
    return {"size": st.st_size, "mtimeNs": st.st_mtime_ns}


def open_uri_chunks(uri: str, where: S3Endpoint | None = None, chunk_size: int = 8 << 20) -> Iterator[bytes]:
    """The bytes of a local file or ``s3://`` object, front to back in chunks (ranged reads on S3)."""
    if uri.startswith("s3://"):
        backend, key = _s3_object(uri, where)
        yield from backend.iter_object(key, chunk_size)
        return
    with open(_local_path(uri), "rb") as f:
        while chunk := f.read(chunk_size):
            yield chunk


class _ObjectRanges:
    """Random access to one object: its size and ranged reads (an ObjectSource)."""

    def __init__(self, backend: Any, key: str, description: str) -> None:
        self._backend, self._key = backend, key
        head = getattr(backend, "head", None)  # S3: size and the ETag every ranged read is pinned to, one HEAD
        found = head(key) if head else {"size": backend.size(key)}
        if found is None or found["size"] is None:
            raise PermanentStoreError(f"{description} does not exist")
        self._size = int(found["size"])
        self._pinned = str(found.get("etag") or "") or None

    @property
    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, length: int, into: bytearray | None = None) -> bytes | bytearray:
        pinned = (self._pinned,) if self._pinned else ()
        data = self._backend.get_range(self._key, offset, length, *pinned)
        if into is None:
            return bytes(data)
        into[:] = data
        return into


def open_uri_source(uri: str, where: S3Endpoint | None = None) -> ObjectSource:
    """Random access (size, ranged reads) to a local file or ``s3://`` object, e.g. for Parquet."""
    if uri.startswith("s3://"):
        backend, key = _s3_object(uri, where)
        return _ObjectRanges(backend, key, uri)
    path = Path(_local_path(uri))
    return _ObjectRanges(LocalBackend(path.parent), path.name, uri)


def dataset_digest(uri: str, where: Any) -> dict[str, Any]:
    """sha256 and size of the dataset's bytes, read front to back as stored (compressed files too)."""
    digest, size = hashlib.sha256(), 0
    for chunk in open_uri_chunks(uri, where):
        digest.update(chunk)
        size += len(chunk)
    return {"uri": uri, "digest": f"sha256:{digest.hexdigest()}", "bytes": size}
