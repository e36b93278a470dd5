"""S3 backend of the store: conditional writes and concurrent multipart uploads.

Three separate pieces, s3transfer-style: :class:`~hsx_extractor.storage.s3_client.S3TransferConfig`
(every knob, one object), :class:`~hsx_extractor.storage.s3_client.Retrier` (error classification
and jittered backoff) and :class:`MultipartUploader` here (the transfer logic), all driving one
boto3 client built by :func:`~hsx_extractor.storage.s3_client.make_client`.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import botocore.config
import botocore.exceptions
from isal import isal_zlib

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage import failpoints
from hsx_extractor.storage.backends import (
    ObjectChanged,
    ObjectSource,
    PermanentStoreError,
    TransientStoreError,
    check_object_size,
)
from hsx_extractor.storage.layout import InvalidKeyError, parse_output_uri, validate_prefix
from hsx_extractor.storage.s3_client import (
    CONFLICT,
    NO_UPLOAD,
    NOT_FOUND,
    PRECONDITION,
    Retrier,
    RetryableConflict,
    S3Endpoint,
    S3TransferConfig,
    classify,
    make_client,
)


class _RestartUpload(Exception):
    """The multipart upload must start over (409 or the upload vanished)."""


MIN_PART_BYTES = 5 << 20  # S3's smallest part but the last


def part_size_for(size: int, config: S3TransferConfig) -> int:
    """At most ``config.part_size``, and small enough that one object alone keeps every
    connection busy: the last shard of a run is uploaded with nothing else to overlap it.
    The parts are as equal as that allows (the last is short by at most one byte per part), so
    one buffer per part thread fits every part of an upload without being reallocated."""
    largest = max(MIN_PART_BYTES, min(config.part_size, -(-size // config.concurrency)))
    count = -(-size // largest)
    even = -(-size // count)
    return even if even >= MIN_PART_BYTES else largest


class MultipartUploader:
    """Uploads objects if absent: concurrent checksummed parts, conditional completion.

    Parts of every upload share one pool of ``config.concurrency`` connections, so shards
    sealed at the same time split the bandwidth instead of multiplying the connections."""

    def __init__(self, client: Any, bucket: str, config: S3TransferConfig, retrier: Retrier):
        self._client = client
        self._bucket = bucket
        self._config = config
        self._retrier = retrier
        self._parts = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="hsx-part")

    def put_if_absent(
        self, key: str, body: bytes | bytearray, metadata: dict[str, str] | None = None
    ) -> bool:
        """Single PUT with ``If-None-Match: *``. True if created, False if the key exists."""
        extra = {"Metadata": metadata} if metadata else {}

        def put() -> bool:
            try:
                self._client.put_object(
                    Bucket=self._bucket,
                    Key=key,
                    Body=body,
                    IfNoneMatch="*",
                    ChecksumCRC32=crc32_header(body),
                    **extra,
                )
            except botocore.exceptions.ClientError as exc:
                kind = classify(exc)
                if kind == PRECONDITION:
                    return False
                if kind == CONFLICT:  # a concurrent write is landing: ask again
                    raise RetryableConflict(str(exc)) from exc
                raise
            return True

        return self._retrier.call("PutObject", key, put)

    def upload_if_absent(self, key: str, source: ObjectSource, metadata: dict[str, str]) -> bool:
        if source.size <= part_size_for(source.size, self._config):
            return self.put_if_absent(key, source.read_at(0, source.size), metadata)
        for _ in range(self._config.max_upload_restarts + 1):
            try:
                return self._upload_once(key, source, metadata)
            except _RestartUpload:
                continue
        raise TransientStoreError(
            f"multipart upload of s3://{self._bucket}/{key} kept conflicting "
            f"({self._config.max_upload_restarts + 1} attempts)"
        )

    def _upload_once(self, key: str, source: ObjectSource, metadata: dict[str, str]) -> bool:
        created = self._retrier.call(
            "CreateMultipartUpload",
            key,
            lambda: self._client.create_multipart_upload(
                Bucket=self._bucket, Key=key, Metadata=metadata, ChecksumAlgorithm="CRC32"
            ),
        )
        upload_id = created["UploadId"]
        try:
            parts = self._upload_parts(key, upload_id, source)
            failpoints.reach("parts-uploaded")
            outcome = self._complete(key, upload_id, parts)
        except BaseException:
            self._abort(key, upload_id)
            raise
        if outcome is None:  # the upload is gone: it may have completed before a lost response
            if self._exists(key):
                return False
            raise _RestartUpload()
        return outcome

    def _upload_parts(self, key: str, upload_id: str, source: ObjectSource) -> list[dict[str, Any]]:
        size = source.size
        step = part_size_for(size, self._config)
        offsets = list(range(0, size, step))

        def upload(number: int, offset: int) -> dict[str, Any]:
            def send() -> dict[str, Any]:
                length = min(step, size - offset)
                body = source.read_at(offset, length, part_body_buffer(length))
                return self._client.upload_part(  # type: ignore[no-any-return]
                    Bucket=self._bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body,
                    ChecksumCRC32=crc32_header(body),
                )

            try:
                resp = self._retrier.call("UploadPart", key, send, passthrough=(NO_UPLOAD,))
            except botocore.exceptions.ClientError as exc:
                raise _RestartUpload() from exc
            failpoints.reach("part-uploaded")
            return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32": resp["ChecksumCRC32"]}

        futures = [self._parts.submit(upload, n + 1, off) for n, off in enumerate(offsets)]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)  # no part of this upload may still be running when it is aborted
            raise

    def _complete(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> bool | None:
        """True: created. False: the key already existed (412). None: the upload is gone."""
        try:
            self._retrier.call(
                "CompleteMultipartUpload",
                key,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self._bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                ),
                passthrough=(PRECONDITION, CONFLICT, NO_UPLOAD),
            )
        except botocore.exceptions.ClientError as exc:
            kind = classify(exc)
            if kind == PRECONDITION:
                self._abort(key, upload_id)
                return False
            if kind == CONFLICT:
                self._abort(key, upload_id)
                raise _RestartUpload() from exc
            return None
        return True

    def _exists(self, key: str) -> bool:
        try:
            self._retrier.call(
                "HeadObject",
                key,
                lambda: self._client.head_object(Bucket=self._bucket, Key=key),
                (NOT_FOUND,),
            )
        except botocore.exceptions.ClientError:
            return False
        return True

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._retrier.call(
                "AbortMultipartUpload",
                key,
                lambda: self._client.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id),
                passthrough=(NO_UPLOAD, NOT_FOUND),
            )
        except Exception:  # best effort; the next restart of this shard aborts it again
            pass


_part_buffers = threading.local()
PART_BUFFER_HEADROOM = 8  # a new part buffer is allocated 1/8 larger than its first part


def part_body_buffer(length: int) -> bytearray:
    """This part thread's body buffer, reused from part to part. A fresh buffer per part is zero-filled
    and page-faulted under the GIL: the part threads held it 0.28 s per GB, half of all the GIL the
    extractor held (bench/gil.py). Parts of an upload differ by a few bytes (part_size_for), and a
    bytearray shrinks and grows in place while it stays between half its allocation and all of it, so
    only a part outside that range gets a new buffer (then kept, with room to grow). A part is sent and
    answered (retries included) before its thread takes the next, so the buffer is free again."""
    buffer: bytearray | None = getattr(_part_buffers, "buffer", None)
    if buffer is None or not buffer.__alloc__() // 2 <= length < buffer.__alloc__():
        # Room for the next shards' parts, a few percent larger: shrunk to size, it keeps its allocation.
        buffer = _part_buffers.buffer = bytearray(length + length // PART_BUFFER_HEADROOM)
    if length < len(buffer):
        del buffer[length:]
    elif length > len(buffer):
        buffer.extend(bytes(length - len(buffer)))
    return buffer


def crc32_header(body: bytes | bytearray | memoryview) -> str:
    """The x-amz-checksum-crc32 value of ``body``. Given precomputed, botocore sends it as a header and the
    body as it is; asked to compute it (ChecksumAlgorithm), it wraps an HTTPS body in aws-chunked framing
    copied in Python under the GIL (~3 GIL-s per GB, issue 17). ISA-L's CRC32 (the same checksum as
    zlib's) runs without the GIL at ~18 GB/s per core, zlib's at ~2."""
    return base64.b64encode(isal_zlib.crc32(body).to_bytes(4, "big")).decode()


class S3Backend:
    """The store's :class:`~hsx_extractor.storage.store.Backend` on one bucket."""

    def __init__(self, client: Any, bucket: str, config: S3TransferConfig, prefix: str = ""):
        self.client = client
        self.bucket = bucket
        self.config = config
        self.description = f"s3://{bucket}"
        self.endpoint_url = str(getattr(getattr(client, "meta", None), "endpoint_url", "") or "the default endpoint")
        self.retrier = Retrier(config, bucket, prefix)
        self.uploader = MultipartUploader(client, bucket, config, self.retrier)

    @classmethod
    def from_output(cls, bucket: str, output: OutputSpec) -> S3Backend:
        config = S3TransferConfig.from_output(output)
        prefix = parse_output_uri(output.uri).prefix if output.uri.startswith("s3://") else ""
        return cls(make_client(S3Endpoint.of(output), config), bucket, config, prefix)

    def preflight(self, prefix: str) -> None:
        """Fail at once, naming the cause, when the bucket is missing or access is denied."""
        self.retrier.call(
            "ListObjectsV2",
            prefix,
            lambda: self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1),
        )

    def probe_conditional_writes(self, prefix: str) -> None:
        """Refuse a store that ignores ``If-None-Match: *``: on such a store a duplicate writer
        silently overwrites what another committed (some MinIO, Ceph and GCS XML versions).

        PUTs one probe key under ``prefix`` twice with ``If-None-Match: *``; the second must be
        refused with 412. (The first may also be refused, after a lost response was retried.)"""
        key = f"{prefix}.hsx-conditional-write-probe-{uuid.uuid4().hex}"
        try:
            self.uploader.put_if_absent(key, b"hsx probe: safe to delete\n")
            overwritten = self.uploader.put_if_absent(key, b"hsx probe, second write: safe to delete\n")
        finally:
            try:
                self.delete(key)
            except Exception:  # best effort: a leftover probe key is harmless and names itself
                pass
        if overwritten:
            raise PermanentStoreError(
                f"the S3 store at {self.endpoint_url} (bucket {self.bucket!r}) ignores conditional "
                "writes: a second PUT with 'If-None-Match: *' of an existing key succeeded instead of "
                "failing with 412 Precondition Failed. On such a store a duplicate writer silently "
                "overwrites committed shards, so hsx refuses to run. Upgrade the store to a version that "
                "honours If-None-Match on PutObject and CompleteMultipartUpload (AWS S3, recent MinIO, "
                "Ceph RGW and SeaweedFS do), or write to another store."
            )

    def get(self, key: str, max_bytes: int) -> bytes | None:
        def fetch() -> tuple[int, bytes]:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            with contextlib.closing(response["Body"]) as body:
                size = int(response.get("ContentLength", 0))
                return size, body.read() if size <= max_bytes else b""

        try:
            size, data = self.retrier.call("GetObject", key, fetch, passthrough=(NOT_FOUND,))
        except botocore.exceptions.ClientError:
            return None
        check_object_size(key, size, max_bytes)  # before any body was read
        return data

    def get_range(self, key: str, start: int, length: int, if_match: str | None = None) -> bytes:
        """``length`` bytes from ``start``; with ``if_match`` (an ETag) only of that version of the object:
        :class:`ObjectChanged` if it was rewritten since."""
        return bytes(self._get_range(key, start, length, None, if_match))

    def get_range_into(self, key: str, start: int, into: memoryview) -> memoryview:
        data = self._get_range(key, start, len(into), into)
        return data if isinstance(data, memoryview) else memoryview(data)

    def _get_range(
        self, key: str, start: int, length: int, into: memoryview | None, if_match: str | None = None
    ) -> bytes | memoryview:
        if length <= 0:
            return b""
        pinned = {"IfMatch": f'"{if_match}"'} if if_match else {}

        def fetch() -> bytes | memoryview:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}", **pinned
            )
            data = resp["Body"].read() if into is None else _read_into(resp["Body"], into)
            total = int(str(resp.get("ContentRange", "/0")).rsplit("/", 1)[-1] or 0)
            if len(data) != min(length, max(total - start, 0)):
                raise botocore.exceptions.IncompleteReadError(actual_bytes=len(data), expected_bytes=length)
            return data

        try:
            return self.retrier.call("GetObject", key, fetch, passthrough=(PRECONDITION,))
        except botocore.exceptions.ClientError as exc:
            raise ObjectChanged(
                f"s3://{self.bucket}/{key} changed while it was read (it was ETag {if_match} when reading began): "
                "what a run reads must stay as it is until the run ends; restore it or start a new runId"
            ) from exc

    def head(self, key: str) -> dict[str, Any] | None:
        """Size and ETag of an object (one HEAD); None when there is none."""
        try:
            resp = self.retrier.call(
                "HeadObject", key, lambda: self.client.head_object(Bucket=self.bucket, Key=key), (NOT_FOUND,)
            )
        except botocore.exceptions.ClientError:
            return None
        return {"size": int(resp["ContentLength"]), "etag": str(resp.get("ETag", "")).strip('"')}

    def size(self, key: str) -> int | None:
        found = self.head(key)
        return None if found is None else int(found["size"])

    def stat(self, key: str) -> dict[str, Any]:
        """Size and ETag of an object: what tells a changed object from an unchanged one."""
        resp = self.retrier.call("HeadObject", key, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        return {"size": int(resp["ContentLength"]), "etag": str(resp.get("ETag", "")).strip('"')}

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.uploader.put_if_absent(key, data)

    def upload_if_absent(self, key: str, source: ObjectSource, metadata: dict[str, str]) -> bool:
        if self.size(key) is not None:  # resume after a lost commit record: no need to re-upload to learn it
            return False
        return self.uploader.upload_if_absent(key, source, metadata)

    def list_keys(self, prefix: str) -> Iterator[str]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self.retrier.call("ListObjectsV2", prefix, partial(self.client.list_objects_v2, **kwargs))
            for obj in page.get("Contents", []):
                yield obj["Key"]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of unfinished multipart uploads under ``prefix``."""
        found: list[tuple[str, str]] = []
        markers: dict[str, str] = {}
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, **markers}
            page = self.retrier.call(
                "ListMultipartUploads", prefix, partial(self.client.list_multipart_uploads, **kwargs)
            )
            found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
            if not page.get("IsTruncated"):
                return found
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_uploads(self, prefix: str) -> int:
        uploads = self.list_uploads(prefix)
        for key, upload_id in uploads:
            self.uploader._abort(key, upload_id)
        return len(uploads)

    def delete(self, key: str) -> None:
        self.retrier.call("DeleteObject", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    def iter_object(self, key: str, chunk_size: int) -> Iterator[bytes]:
        """The object front to back, every ranged read pinned to the ETag it had when reading began."""
        version = self.head(key)
        if version is None:
            raise PermanentStoreError(f"s3://{self.bucket}/{key} does not exist")
        size, etag = int(version["size"]), str(version["etag"]) or None
        for offset in range(0, size, chunk_size):
            yield self.get_range(key, offset, min(chunk_size, size - offset), etag)


def split_object_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key), with the key validated like a prefix."""
    location = parse_output_uri(uri)
    if location.bucket is None or not location.prefix:
        raise InvalidKeyError(f"{uri!r} does not name an object (s3://bucket/key)")
    return location.bucket, validate_prefix(location.prefix)


def _read_into(body: Any, view: memoryview) -> memoryview:
    """A response body read into ``view`` (a reused buffer: no fresh pages per read); what it held."""
    got = 0
    while got < len(view):
        n = body.readinto(view[got:])
        if not n:
            break
        got += n
    if body.read(1):
        raise botocore.exceptions.IncompleteReadError(actual_bytes=got + 1, expected_bytes=len(view))
    return view[:got]
