"""An S3-compatible sink that discards object bodies, so a benchmark measures the extractor's own cost apart
from any S3 server (issue 17 item 1). Not a store: it keeps small objects (plan, commit records, manifest,
probes) so a run can read them back, and only the size and ETag of larger ones (a GET of those is refused,
loudly). Conditional writes are honoured (`If-None-Match: *` on PutObject and CompleteMultipartUpload answers
412 for an existing key), so hsx's store probe and exactly-once protocol run unchanged.

    python -m bench.null_s3 [--port 0] [--tls-cert C --tls-key K]   # prints "listening http(s)://127.0.0.1:PORT"

Bodies are read into one reused buffer per connection (plain and aws-chunked framing), nothing is hashed or
checked; the upload checksum the client sent is echoed back as S3 does. Requests are not authenticated.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

KEEP_BODIES_UP_TO = 1 << 20
CHUNK = 1 << 20


@dataclass
class Stored:
    size: int
    etag: str
    body: bytes | None  # None: discarded
    modified: float


class Sink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[tuple[str, str], Stored] = {}
        self.uploads: dict[str, tuple[str, str, float]] = {}  # upload id -> (bucket, key, started)
        self.part_sizes: dict[str, dict[int, int]] = {}  # upload id -> part number -> bytes
        self.bytes_discarded = 0
        self.slow_shards = 0.0  # seconds each PUT under /shards/ waits


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    sink: Sink
    server_version = "hsx-null-s3"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without this, Nagle and delayed ACKs stall each reply.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- body ----------------------------------------------------------------------------------------
    def _buffer(self) -> memoryview:
        if not hasattr(self, "_buf"):
            self._buf = memoryview(bytearray(CHUNK))
        return self._buf

    def _read_exact(self, n: int, keep: bytearray | None) -> None:
        buf = self._buffer()
        while n > 0:
            got = self.rfile.readinto(buf[: min(n, CHUNK)])
            if not got:
                raise ConnectionError("client closed mid-body")
            if keep is not None:
                keep += buf[:got]
            n -= got

    def _body(self) -> tuple[int, bytes | None, dict[str, str]]:
        """(decoded size, the bytes if small enough to keep, trailing headers)."""
        length = int(self.headers.get("Content-Length") or 0)
        chunked = "aws-chunked" in (self.headers.get("Content-Encoding") or "")
        decoded = int(self.headers.get("x-amz-decoded-content-length") or length)
        keep = bytearray() if decoded <= KEEP_BODIES_UP_TO else None
        trailers: dict[str, str] = {}
        if not chunked:
            self._read_exact(length, keep)
            return length, bytes(keep) if keep is not None else None, trailers
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                break
            self._read_exact(size, keep)
            self.rfile.readline()
        while (line := self.rfile.readline().strip()) != b"":
            name, _, value = line.decode().partition(":")
            trailers[name.strip().lower()] = value.strip()
        return decoded, bytes(keep) if keep is not None else None, trailers

    # -- replies -------------------------------------------------------------------------------------
    def _reply(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, code: int, s3_code: str, message: str) -> None:
        xml = f"<Error><Code>{s3_code}</Code><Message>{escape(message)}</Message></Error>"
        self._reply(code, xml.encode(), {"Content-Type": "application/xml"})

    def _where(self) -> tuple[str, str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        bucket, _, key = parts.path.lstrip("/").partition("/")
        return unquote(bucket), unquote(key), parse_qs(parts.query, keep_blank_values=True)

    def _checksum_headers(self, trailers: dict[str, str]) -> dict[str, str]:
        name = "x-amz-checksum-crc32"
        value = trailers.get(name) or self.headers.get(name)
        return {name: value} if value else {}

    # -- verbs ---------------------------------------------------------------------------------------
    def do_PUT(self) -> None:
        bucket, key, query = self._where()
        size, body, trailers = self._body()
        sink = self.sink
        if sink.slow_shards and "/shards/" in key:  # a store slower than extraction (bench.hostile_memory)
            time.sleep(sink.slow_shards)
        if "uploadId" in query:  # UploadPart
            with sink.lock:
                upload_id = query["uploadId"][0]
                known = upload_id in sink.uploads
                if known:
                    sink.part_sizes.setdefault(upload_id, {})[int(query["partNumber"][0])] = size
                sink.bytes_discarded += size
            if not known:
                return self._error(404, "NoSuchUpload", "no such upload")
            etag = f'"{uuid.uuid4().hex}"'
            return self._reply(200, headers={"ETag": etag, **self._checksum_headers(trailers)})
        etag = f'"{hashlib.md5(body).hexdigest() if body is not None else uuid.uuid4().hex}"'
        with sink.lock:
            if self.headers.get("If-None-Match") == "*" and (bucket, key) in sink.objects:
                return self._error(412, "PreconditionFailed", "At least one of the pre-conditions failed")
            sink.objects[(bucket, key)] = Stored(size, etag, body, time.time())
            if body is None:
                sink.bytes_discarded += size
        self._reply(200, headers={"ETag": etag, **self._checksum_headers(trailers)})

    def do_POST(self) -> None:
        bucket, key, query = self._where()
        self._body()
        sink = self.sink
        if "uploads" in query:
            upload_id = uuid.uuid4().hex
            with sink.lock:
                sink.uploads[upload_id] = (bucket, key, time.time())
            xml = (
                f"<InitiateMultipartUploadResult><Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key>"
                f"<UploadId>{upload_id}</UploadId></InitiateMultipartUploadResult>"
            )
            return self._reply(200, xml.encode(), {"Content-Type": "application/xml", "x-amz-checksum-algorithm": "CRC32"})
        if "uploadId" in query:
            upload_id = query["uploadId"][0]
            etag = f'"{uuid.uuid4().hex}-1"'
            with sink.lock:
                if upload_id not in sink.uploads:
                    return self._error(404, "NoSuchUpload", "no such upload")
                if self.headers.get("If-None-Match") == "*" and (bucket, key) in sink.objects:
                    return self._error(412, "PreconditionFailed", "At least one of the pre-conditions failed")
                del sink.uploads[upload_id]
                size = sum(sink.part_sizes.pop(upload_id, {}).values())  # every part sent (none are checked)
                sink.objects[(bucket, key)] = Stored(size, etag, None, time.time())
            xml = (
                f"<CompleteMultipartUploadResult><Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key>"
                f"<ETag>{escape(etag)}</ETag></CompleteMultipartUploadResult>"
            )
            return self._reply(200, xml.encode(), {"Content-Type": "application/xml"})
        self._error(501, "NotImplemented", f"POST {self.path}")

    def do_DELETE(self) -> None:
        bucket, key, query = self._where()
        with self.sink.lock:
            if "uploadId" in query:
                if self.sink.uploads.pop(query["uploadId"][0], None) is None:
                    return self._error(404, "NoSuchUpload", "no such upload")
                self.sink.part_sizes.pop(query["uploadId"][0], None)
            else:
                self.sink.objects.pop((bucket, key), None)
        self._reply(204)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        bucket, key, query = self._where()
        if not key:
            if "uploads" in query:
                return self._list_uploads(bucket, query)
            return self._list(bucket, query)
        with self.sink.lock:
            obj = self.sink.objects.get((bucket, key))
        if obj is None:
            return self._error(404, "NoSuchKey", "The specified key does not exist.")
        headers = {"ETag": obj.etag, "Last-Modified": formatdate(obj.modified, usegmt=True)}
        if self.command == "HEAD":
            self.send_response(200)
            for k, v in {**headers, "Content-Length": str(obj.size)}.items():
                self.send_header(k, v)
            return self.end_headers()
        if obj.body is None:
            return self._error(501, "NotImplemented", f"null sink: the body of {key} ({obj.size} bytes) was discarded")
        body, code = obj.body, 200
        wanted = self.headers.get("Range")
        if wanted and wanted.startswith("bytes="):
            start_s, _, end_s = wanted[6:].partition("-")
            if not start_s:  # a suffix: the last N bytes
                start, end = max(len(body) - int(end_s), 0), len(body) - 1
            else:
                start, end = int(start_s), min(int(end_s) if end_s else len(body) - 1, len(body) - 1)
            if start >= len(body):
                return self._error(416, "InvalidRange", "The requested range is not satisfiable")
            headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
            body, code = body[start : end + 1], 206
        self._reply(code, body, headers)

    def _list(self, bucket: str, query: dict[str, list[str]]) -> None:
        prefix = query.get("prefix", [""])[0]
        limit = int(query.get("max-keys", ["1000"])[0])
        after = query.get("continuation-token", query.get("start-after", [""]))[0]
        with self.sink.lock:
            keys = sorted(k for (b, k) in self.sink.objects if b == bucket and k.startswith(prefix) and k > after)
            page = [(k, self.sink.objects[(bucket, k)]) for k in keys[:limit]]
        truncated = len(keys) > limit
        items = "".join(
            f"<Contents><Key>{escape(k)}</Key><Size>{o.size}</Size><ETag>{escape(o.etag)}</ETag>"
            f"<LastModified>{time.strftime('%Y-%m-%dT%H:%M:%S.000Z', time.gmtime(o.modified))}</LastModified>"
            "</Contents>"
            for k, o in page
        )
        token = f"<NextContinuationToken>{escape(page[-1][0])}</NextContinuationToken>" if truncated else ""
        xml = (
            f"<ListBucketResult><Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(page)}</KeyCount><MaxKeys>{limit}</MaxKeys>"
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>{token}{items}</ListBucketResult>"
        )
        self._reply(200, xml.encode(), {"Content-Type": "application/xml"})

    def _list_uploads(self, bucket: str, query: dict[str, list[str]]) -> None:
        prefix = query.get("prefix", [""])[0]
        with self.sink.lock:
            ups = [(u, k) for u, (b, k, _) in self.sink.uploads.items() if b == bucket and k.startswith(prefix)]
        items = "".join(f"<Upload><Key>{escape(k)}</Key><UploadId>{u}</UploadId></Upload>" for u, k in ups)
        xml = (
            f"<ListMultipartUploadsResult><Bucket>{escape(bucket)}</Bucket><IsTruncated>false</IsTruncated>"
            f"{items}</ListMultipartUploadsResult>"
        )
        self._reply(200, xml.encode(), {"Content-Type": "application/xml"})


def serve(port: int = 0, slow_shards: float = 0.0) -> ThreadingHTTPServer:
    sink = Sink()
    sink.slow_shards = slow_shards
    handler = type("SinkHandler", (Handler,), {"sink": sink})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.null_s3", description=__doc__)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM) ...")
    p.add_argument("--tls-key", help="... and this key (PEM)")
    p.add_argument("--slow-shards", type=float, default=0.0, help="seconds each PUT of a shard's bytes waits")
    args = p.parse_args(argv)
    server = serve(args.port, args.slow_shards)
    scheme = "http"
    if args.tls_cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.tls_cert, args.tls_key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    print(f"listening {scheme}://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

