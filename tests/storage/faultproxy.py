"""A fault-injecting HTTP/1.1 proxy in front of a real S3 server (127.0.0.1 only).

Requests are forwarded byte for byte (so SigV4 signatures stay valid), one fresh upstream
connection per request. A seeded fraction of requests instead gets one fault:

* ``error``        - a 503 SlowDown answer, the upstream never sees the request;
* ``reset_before`` - the connection is reset before forwarding;
* ``reset_after``  - forwarded and executed upstream, then the connection is reset: the client
  never learns that its request succeeded (the case exactly-once has to survive);
* ``slow``         - forwarded after a delay.

``slow_matching`` delays every request whose target contains that text (to widen a window).

With ``tls`` (a server-side SSL context) the proxy speaks HTTPS to its clients and plain HTTP upstream:
an S3 endpoint behind a private CA, as on-prem stores are (with a plan of ``rate=0`` it only terminates TLS).

``strip_if_none_match`` (with the server's ``secret_key``) removes the ``If-None-Match`` header
from every request and signs it again (SigV4, same identity and date): the server then sees a
plain PUT or complete, like a store that ignores conditional writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import random
import ssl
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

FAULTS = ("error", "reset_before", "reset_after", "slow")


def _error_response(status: int, code: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        "<Message>Injected by the test fault proxy</Message></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} Injected\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Injection:
    """Answer the first ``times`` requests matching method and target text with an S3 error
    (or, with ``delay_seconds``, forward them only after that delay; with ``reset_after``, forward
    them, then reset the connection: done upstream, and the client never hears so)."""

    method: str
    target_contains: str
    status: int = 0
    code: str = ""
    times: int = 1
    delay_seconds: float = 0.0
    reset_after: bool = False


@dataclass
class FaultPlan:
    """What the proxy does to traffic."""

    seed: int
    rate: float = 0.1  # fraction of requests that get a fault
    faults: tuple[str, ...] = FAULTS
    slow_seconds: float = 0.3
    slow_matching: str | None = None
    injections: list[Injection] = field(default_factory=list)
    # Every Nth request gets a fault too (its kind drawn as the others'), so a run of a few dozen requests
    # meets some whatever the seed: at rate 0.1, 61 requests draw fewer than 3 faults ~5% of the time.
    fault_every: int = 0
    strip_if_none_match: bool = False
    secret_key: str = ""  # to sign requests again once a header is stripped


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            fields[name.strip().lower()] = value.strip()
    return lines[0], fields


async def _read_body(reader: asyncio.StreamReader, fields: dict[str, str], until_eof: bool) -> bytes:
    if "chunked" in fields.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            raw += line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    raw += trailer
                raw += b"\r\n"
                return bytes(raw)
            raw += await reader.readexactly(size + 2)
    if "content-length" in fields:
        return await reader.readexactly(int(fields["content-length"]))
    return await reader.read() if until_eof else b""


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def resign_without(head: bytes, drop: str, secret_key: str) -> bytes:
    """The request head without header ``drop``, its SigV4 ``Authorization`` computed again."""
    lines = head.decode("latin-1").split("\r\n")
    request_line, header_lines = lines[0], [line for line in lines[1:] if line]
    kept = [line for line in header_lines if line.split(":", 1)[0].strip().lower() != drop]
    fields = {line.split(":", 1)[0].strip().lower(): line.split(":", 1)[1].strip() for line in kept}
    auth = fields["authorization"]
    algorithm, _, rest = auth.partition(" ")
    parts = dict(p.strip().split("=", 1) for p in rest.split(","))
    signed = [h for h in parts["SignedHeaders"].split(";") if h != drop]
    method, target = request_line.split()[0], request_line.split()[1]
    url = urlsplit(target)
    query = "&".join(
        sorted(f"{k}={v}" for k, _, v in (q.partition("=") for q in url.query.split("&") if q))
    )
    canonical = "\n".join(
        [
            method,
            url.path,
            query,
            "".join(f"{h}:{' '.join(fields[h].split())}\n" for h in signed),
            ";".join(signed),
            fields["x-amz-content-sha256"],
        ]
    )
    scope = parts["Credential"].split("/", 1)[1]
    date, region, service, _ = scope.split("/")
    to_sign = "\n".join([algorithm, fields["x-amz-date"], scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), date), region), service), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    new_auth = f"{algorithm} Credential={parts['Credential']}, SignedHeaders={';'.join(signed)}, Signature={signature}"
    out = [request_line] + [
        f"Authorization: {new_auth}" if line.lower().startswith("authorization:") else line for line in kept
    ]
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")


class FaultProxy:
    """Run with ``with FaultProxy(upstream, plan) as proxy: ... proxy.endpoint ...``."""

    def __init__(self, upstream: str, plan: FaultPlan, tls: ssl.SSLContext | None = None):
        parts = urlsplit(upstream)
        self._tls = tls
        self._up_host, self._up_port = parts.hostname or "127.0.0.1", parts.port or 80
        self.plan = plan
        self.counts: Counter[str] = Counter()
        self._random = random.Random(plan.seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.endpoint = ""

    def _injected(self, method: str, target: str) -> Injection | None:
        for injection in self.plan.injections:
            if injection.times > 0 and method == injection.method and injection.target_contains in target:
                injection.times -= 1
                what = "reset_after" if injection.reset_after else f"{injection.status} {injection.code}"
                self.counts[f"injected {what}"] += 1
                return injection
        return None

    def _pick(self, target: str) -> str | None:
        self.counts["requests"] += 1
        forced = bool(self.plan.fault_every) and self.counts["requests"] % self.plan.fault_every == 0
        if self._random.random() >= self.plan.rate and not forced:
            return "slow" if self.plan.slow_matching and self.plan.slow_matching in target else None
        fault = self._random.choice(self.plan.faults)
        self.counts[fault] += 1
        return fault

    async def _exchange(self, request: bytes, method: str) -> bytes:
        reader, writer = await asyncio.open_connection(self._up_host, self._up_port)
        try:
            writer.write(request)
            await writer.drain()
            while True:
                head = await _read_head(reader)
                if head is None:
                    raise ConnectionResetError("upstream closed without a response")
                status_line, fields = _headers(head)
                status = int(status_line.split()[1])
                if 100 <= status < 200:
                    continue  # interim answer (100 Continue): the client already got ours
                no_body = method == "HEAD" or status in (204, 304)
                body = b"" if no_body else await _read_body(reader, fields, until_eof=True)
                return head + body
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            while (head := await _read_head(reader)) is not None:
                request_line, fields = _headers(head)
                method, target = request_line.split()[0], request_line.split()[1]
                if fields.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                body = await _read_body(reader, fields, until_eof=False)
                injected = self._injected(method, target)
                if injected is not None and injected.delay_seconds:
                    await asyncio.sleep(injected.delay_seconds)
                elif injected is not None and not injected.reset_after:
                    writer.write(_error_response(injected.status, injected.code))
                    await writer.drain()
                    continue
                if self.plan.strip_if_none_match and "if-none-match" in fields:
                    head = resign_without(head, "if-none-match", self.plan.secret_key)
                    self.counts["stripped if-none-match"] += 1
                fault = None if injected is not None else self._pick(target)
                if fault == "error":
                    writer.write(_error_response(503, "SlowDown"))
                    await writer.drain()
                    continue
                if fault == "reset_before":
                    writer.transport.abort()
                    return
                if fault == "slow":
                    await asyncio.sleep(self.plan.slow_seconds)
                response = await self._exchange(head + body, method)
                if fault == "reset_after" or (injected is not None and injected.reset_after):
                    writer.transport.abort()
                    return
                writer.write(response)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
            writer.transport.abort()
        except asyncio.CancelledError:  # proxy shutting down: end quietly
            writer.transport.abort()
        finally:
            with contextlib.suppress(RuntimeError):
                writer.close()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._tls), self._loop
        ).result(timeout=10)
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"{'https' if self._tls else 'http'}://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


@contextlib.contextmanager
def fault_proxy(upstream: str, plan: FaultPlan, tls: ssl.SSLContext | None = None) -> Iterator[FaultProxy]:
    with FaultProxy(upstream, plan, tls) as proxy:
        yield proxy


def serving_context(cert_pem: bytes, key_pem: bytes, directory: Path) -> ssl.SSLContext:
    """A server-side SSL context for ``FaultProxy(tls=...)`` from a PEM certificate and key."""
    cert, key = directory / "proxy.crt", directory / "proxy.key"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context
