"""What the S3 client puts on the wire over HTTPS (no TLS S3 server runs here: botocore's own request
pipeline runs to its last step, `before-send`, which answers in place of the network).

hsx passes each body's CRC32 precomputed: botocore then sends it as a header and the body as it is. Asked to
compute it instead (ChecksumAlgorithm), botocore wraps an HTTPS body in aws-chunked framing that it copies in
Python under the GIL, ~3 GIL-seconds per GB (issue 17)."""

from __future__ import annotations

import base64
import ctypes
import threading
import zlib
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse

from hsx_extractor.storage.s3 import MultipartUploader, part_body_buffer
from hsx_extractor.storage.s3_client import Retrier, S3Endpoint, S3TransferConfig, make_client

BODY = bytes(range(256)) * 4096  # 1 MiB


class _Raw:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Any:
        yield self._data


def https_client(sent: list[Any]) -> Any:
    client = make_client(
        S3Endpoint("https://s3.hsx-test.invalid", "us-east-1", True, ("AKIDTEST", "secret", None)),
        S3TransferConfig(),
    )

    def answer(request: Any, **_: Any) -> AWSResponse:
        sent.append(request)
        crc = request.headers.get("x-amz-checksum-crc32", b"")
        headers = {"ETag": '"e"', "x-amz-checksum-crc32": crc.decode() if isinstance(crc, bytes) else crc}
        return AWSResponse(request.url, 200, headers, _Raw(b""))

    client.meta.events.register("before-send", answer)
    return client


def body_bytes(request: Any) -> bytes:
    body = request.body
    return body if isinstance(body, bytes) else bytes(body.read())


def test_hsx_uploads_send_the_body_as_is_with_its_crc32_in_a_header() -> None:
    sent: list[Any] = []
    client = https_client(sent)
    config = S3TransferConfig()
    uploader = MultipartUploader(client, "bucket", config, Retrier(config, "bucket", "p"))
    assert uploader.put_if_absent("p/plan.json", BODY)
    (put,) = sent
    want = base64.b64encode(zlib.crc32(BODY).to_bytes(4, "big")).decode()
    assert put.headers["x-amz-checksum-crc32"] in (want, want.encode())
    assert b"aws-chunked" not in str(put.headers).encode()
    assert put.headers["x-amz-content-sha256"] in ("UNSIGNED-PAYLOAD", b"UNSIGNED-PAYLOAD")
    assert body_bytes(put) == BODY


@pytest.mark.parametrize("operation", ["put_object", "upload_part"])
def test_without_a_precomputed_crc32_botocore_would_frame_the_body(operation: str) -> None:
    """The check above can fail: asked for ChecksumAlgorithm, botocore chunks the body over HTTPS."""
    sent: list[Any] = []
    client = https_client(sent)
    extra = {"UploadId": "u", "PartNumber": 1} if operation == "upload_part" else {}
    getattr(client, operation)(Bucket="bucket", Key="k", Body=BODY, ChecksumAlgorithm="CRC32", **extra)
    (request,) = sent
    assert "aws-chunked" in str(request.headers.get("Content-Encoding", b""))


def _address(buffer: bytearray) -> int:
    view = (ctypes.c_char * 1).from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # an exported buffer cannot be resized


def test_part_bodies_reuse_one_buffer_per_thread() -> None:
    """Each part thread fills the same memory for every part of an upload (no fresh zero-filled pages per
    part): a last part a few bytes shorter, and the next upload's slightly larger parts, resize it in place."""
    full = part_body_buffer(1 << 16)
    where, allocated = _address(full), full.__alloc__()
    assert part_body_buffer(1 << 16) is full and len(full) == 1 << 16
    assert part_body_buffer((1 << 16) + 999) is full  # the next shard's parts are a bit larger
    last = part_body_buffer((1 << 16) - 7)
    assert last is full and len(last) == (1 << 16) - 7
    again = part_body_buffer(1 << 16)
    assert again is full and len(again) == 1 << 16
    assert part_body_buffer(3 << 14) is full and len(full) == 3 << 14
    assert (_address(full), full.__alloc__()) == (where, allocated)  # never moved nor reallocated
    smaller = part_body_buffer(1000)  # under half of it: resizing in place would reallocate
    assert smaller is not full and len(smaller) == 1000
    bigger = part_body_buffer(1 << 17)  # over the allocation of the one kept
    assert bigger is not smaller and len(bigger) == 1 << 17 and part_body_buffer(1 << 17) is bigger
    elsewhere: list[bytearray] = []
    thread = threading.Thread(target=lambda: elsewhere.append(part_body_buffer(1 << 17)))
    thread.start()
    thread.join()
    assert elsewhere[0] is not bigger  # one per thread: two parts in flight never share one
