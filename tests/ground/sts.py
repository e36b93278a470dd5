"""A web-identity issuer for tests: AWS STS's AssumeRoleWithWebIdentity on 127.0.0.1, as EKS IRSA, GKE and
Azure workload identity reach it from a pod (a projected token file, a role, the SDK's default chain).

It accepts one token for one role and answers with the test S3 server's keys. The session token it
returns is empty: SeaweedFS would look a non-empty one up as its own temporary credentials, and
botocore sends no ``X-Amz-Security-Token`` for an empty one. Every call is recorded (``calls``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

_OK = """<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <AssumeRoleWithWebIdentityResult>
    <Credentials>
      <AccessKeyId>{key}</AccessKeyId>
      <SecretAccessKey>{secret}</SecretAccessKey>
      <SessionToken></SessionToken>
      <Expiration>{expires}</Expiration>
    </Credentials>
    <AssumedRoleUser><Arn>{role}/hsx</Arn><AssumedRoleId>AROATEST:hsx</AssumedRoleId></AssumedRoleUser>
  </AssumeRoleWithWebIdentityResult>
</AssumeRoleWithWebIdentityResponse>"""
_DENIED = """<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <Error><Type>Sender</Type><Code>InvalidIdentityToken</Code><Message>{message}</Message></Error>
</ErrorResponse>"""


@dataclass
class Issuer:
    """The issuer's one token and role, the keys it hands out, and what it was asked."""

    token: str
    role_arn: str
    access_key: str
    secret_key: str
    endpoint: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)

    def answer(self, form: dict[str, str]) -> tuple[int, str]:
        self.calls.append(form)
        if form.get("Action") != "AssumeRoleWithWebIdentity":
            return 400, _DENIED.format(message=escape(f"unsupported action {form.get('Action')!r}"))
        if form.get("RoleArn") != self.role_arn or form.get("WebIdentityToken") != self.token:
            return 400, _DENIED.format(message="the token or the role is not the one this issuer trusts")
        expires = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return 200, _OK.format(key=escape(self.access_key), secret=escape(self.secret_key), expires=expires,
                               role=escape(self.role_arn))  # fmt: skip


def _handler(issuer: Issuer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            form = {k: v[0] for k, v in parse_qs(body).items()}
            status, text = issuer.answer(form)
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/xml")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextlib.contextmanager
def web_identity_issuer(token: str, role_arn: str, access_key: str, secret_key: str) -> Iterator[Issuer]:
    """Serve an :class:`Issuer` on a free 127.0.0.1 port (its ``endpoint``) until the block ends."""
    issuer = Issuer(token, role_arn, access_key, secret_key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(issuer))
    issuer.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield issuer
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
