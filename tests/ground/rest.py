"""A small JSON client for the Kubernetes API (client-certificate auth), used by the node agent.

Plain dicts in and out, explicit patch types, and a line-by-line watch: what the agent needs and no more.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import urlencode

import urllib3

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class KubeRest:
    """Thread-safe (urllib3 pools) JSON access to one API server as one identity."""

    def __init__(self, server: str, ca_path: Path, cert_path: Path, key_path: Path, timeout_s: float = 30.0):
        self.server = server.rstrip("/")
        self._timeout = timeout_s
        self._http = urllib3.PoolManager(
            num_pools=4,
            maxsize=16,
            cert_reqs="CERT_REQUIRED",
            ca_certs=str(ca_path),
            cert_file=str(cert_path),
            key_file=str(key_path),
        )

    def _url(self, path: str, params: Mapping[str, object] | None) -> str:
        query = f"?{urlencode({k: v for k, v in params.items() if v is not None})}" if params else ""
        return f"{self.server}{path}{query}"

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        params: Mapping[str, object] | None = None,
        content_type: str = "application/json",
    ) -> dict:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        response = self._http.request(
            method, self._url(path, params), body=data, headers=headers, timeout=self._timeout, retries=False
        )
        text = response.data.decode(errors="replace")
        if not 200 <= response.status < 300:
            raise ApiError(response.status, method, path, text)
        return json.loads(text) if text else {}

    def get(self, path: str, **params: object) -> dict:
        return self.request("GET", path, params=params)

    def watch(
        self, path: str, resource_version: str, timeout_s: int = 20, **params: object
    ) -> Iterator[dict]:
        """Watch events ({type, object}) from resource_version until the server closes the stream."""
        query = {**params, "watch": "true", "resourceVersion": resource_version, "timeoutSeconds": timeout_s}
        response = self._http.request(
            "GET",
            self._url(path, query),
            headers={"Accept": "application/json"},
            preload_content=False,
            timeout=urllib3.Timeout(connect=10, read=timeout_s + 10),
            retries=False,
        )
        try:
            if response.status != 200:
                raise ApiError(response.status, "WATCH", path, response.read().decode(errors="replace"))
            buffer = b""
            for chunk in response.stream(65536):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            response.release_conn()
