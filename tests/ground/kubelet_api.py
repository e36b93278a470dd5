"""The part of the kubelet's HTTPS API the API server proxies for `kubectl logs`: GET
/containerLogs/{namespace}/{pod}/{container} with tailLines, limitBytes and follow.

Served on the node's InternalIP with a certificate of the cluster's CA; only clients presenting a
certificate of that CA are answered (the API server's kubelet-client certificate), as a kubelet
with x509 authentication does.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# (namespace, pod, container) -> the log file, and whether the container may still write to it.
LogSource = Callable[[str, str, str], tuple[Path, Callable[[], bool]] | None]
FOLLOW_POLL_S = 0.2


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    kept = data.splitlines(keepends=True)[-lines:]
    return b"".join(kept)


class _Handler(BaseHTTPRequestHandler):
    server: KubeletLogServer
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes (follow streams)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        if len(parts) != 4 or parts[0] != "containerLogs":
            self.send_error(404, "only /containerLogs/{namespace}/{pod}/{container} is served")
            return
        found = self.server.source(parts[1], parts[2], parts[3])
        if found is None:
            self.send_error(404, f"container {parts[3]} of pod {parts[1]}/{parts[2]} is not on this node")
            return
        path, alive = found
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        follow = query.get("follow") == "true"
        limit = int(query["limitBytes"]) if query.get("limitBytes", "").isdigit() else None
        data = path.read_bytes() if path.exists() else b""
        if query.get("tailLines", "").isdigit():
            data = _tail(data, int(query["tailLines"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        sent = self._send(data, limit, 0)
        if not follow:
            return
        offset = path.stat().st_size if path.exists() else 0
        while limit is None or sent < limit:
            still = alive()
            size = path.stat().st_size if path.exists() else 0
            if size > offset:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read(size - offset)
                offset = size
                try:
                    sent = self._send(chunk, limit, sent)
                except OSError:
                    return  # the client went away
            elif not still:
                return
            time.sleep(FOLLOW_POLL_S)

    def _send(self, data: bytes, limit: int | None, sent: int) -> int:
        if limit is not None:
            data = data[: max(0, limit - sent)]
        self.wfile.write(data)
        self.wfile.flush()
        return sent + len(data)


class KubeletLogServer(ThreadingHTTPServer):
    """`kubectl logs` for the node agent's pods; ``port`` is what the Node's kubeletEndpoint says."""

    daemon_threads = True

    def __init__(self, address: str, cert: Path, key: Path, client_ca: Path, source: LogSource):
        super().__init__((address, 0), _Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.source = source
        self.port = self.server_address[1]
        self._thread = threading.Thread(target=self.serve_forever, name="kubelet-logs", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
