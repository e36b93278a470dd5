"""The S3 client side of the store: which store and as whom (:class:`S3Endpoint`), every transfer
knob (:class:`S3TransferConfig`), the boto3 client, and one retry policy (:class:`Retrier`).
botocore's own retries are off so that one policy decides.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import urllib3.exceptions

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.backends import PermanentStoreError, TransientStoreError

T = TypeVar("T")

TRANSIENT: Final = "transient"
PERMANENT: Final = "permanent"
PRECONDITION: Final = "precondition"  # 412: the key exists
CONFLICT: Final = "conflict"  # 409: a concurrent conditional write
NO_UPLOAD: Final = "no_upload"  # the multipart upload is gone (aborted by a restarted writer)
NOT_FOUND: Final = "not_found"

_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
_CONNECTION_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.FlexibleChecksumError,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    TimeoutError,
)
_CAUSES = {
    "InvalidAccessKeyId": "bad credentials: the access key is unknown (check AWS_ACCESS_KEY_ID / credentialsSecret)",
    "SignatureDoesNotMatch": "bad credentials: the secret key is wrong (check AWS_SECRET_ACCESS_KEY / credentialsSecret)",
    "AccessDenied": "access denied by the bucket policy or IAM",
    "NoSuchBucket": "the bucket does not exist",
    "InvalidBucketName": "the bucket name is invalid",
    "ExpiredToken": "the session token expired",
    "InvalidToken": "the session token is invalid",
    # Every retry is signed with the same wrong clock: waiting cannot help, fixing the clock does.
    "RequestTimeTooSkewed": "this machine's clock differs from the store's by more than it allows "
    "(RequestTimeTooSkewed): sync the node's clock (NTP/chrony) and restart",
}


@dataclass(frozen=True)
class S3TransferConfig:
    """Every S3 transfer knob in one object."""

    part_size: int = 64 << 20  # multipart part size in bytes (>= 5 MiB)
    concurrency: int = 16  # parts in flight per upload
    max_attempts: int = 8  # tries of one request before a transient error is fatal
    backoff_base: float = 0.1  # seconds; the n-th retry sleeps uniform(0, min(cap, base * 2**n))
    backoff_cap: float = 8.0
    max_upload_restarts: int = 4  # fresh multipart uploads after 409 / a vanished upload
    connect_timeout: float = 10.0
    read_timeout: float = 120.0

    @classmethod
    def from_output(cls, output: OutputSpec) -> S3TransferConfig:
        return cls(part_size=output.partSizeBytes, concurrency=output.uploadConcurrency)


@dataclass(frozen=True)
class S3Endpoint:
    """Which S3-compatible store to talk to, and as whom (``credentials`` None: the AWS chain)."""

    endpoint: str | None = None
    region: str | None = None
    path_style: bool = False
    # (access key id, secret access key, session token or None)
    credentials: tuple[str, str, str | None] | None = None

    @classmethod
    def of(cls, output: OutputSpec) -> S3Endpoint:
        return cls(output.endpoint, output.region, output.pathStyle)


def make_client(where: S3Endpoint, config: S3TransferConfig) -> Any:
    """A boto3 S3 client: credentials given or from the AWS chain, optional endpoint and path style."""
    # Every request carries a CRC32 of its body in a signed header, so the body is not hashed
    # again for the signature: on plain-HTTP endpoints botocore would SHA-256 every byte, a second
    # full pass over each part (~1.4 GB/s per core on the benchmark machine). Without pathStyle
    # the AWS config chain decides the addressing style (s3.addressing_style in ~/.aws/config);
    # these options are merged into it.
    s3_options: Any = {"payload_signing_enabled": False}
    if where.path_style:
        s3_options["addressing_style"] = "path"
    client_config = botocore.config.Config(
        region_name=where.region,
        s3=s3_options,
        retries={"total_max_attempts": 1},
        max_pool_connections=config.concurrency + 8,
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
    )
    session = boto3.session.Session()
    if where.credentials is not None:
        key, secret, token = where.credentials
        session = boto3.session.Session(
            aws_access_key_id=key, aws_secret_access_key=secret, aws_session_token=token
        )
    return session.client("s3", endpoint_url=where.endpoint, config=client_config)


def error_code(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, botocore.exceptions.ClientError):
        err = exc.response.get("Error", {})
        meta = exc.response.get("ResponseMetadata", {})
        return str(err.get("Code", "")), int(meta.get("HTTPStatusCode", 0) or 0)
    return type(exc).__name__, 0


def classify(exc: BaseException) -> str:
    """Which of TRANSIENT, PERMANENT, PRECONDITION, CONFLICT, NO_UPLOAD, NOT_FOUND ``exc`` is."""
    if isinstance(exc, RetryableConflict):
        return TRANSIENT
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = error_code(exc)
        if status == 412 or code == "PreconditionFailed":
            return PRECONDITION
        if code == "NoSuchUpload":
            return NO_UPLOAD
        if code in ("NoSuchKey", "NotFound") or (status == 404 and code in ("404", "")):
            return NOT_FOUND
        if status == 409 and code != "BucketAlreadyExists":
            return CONFLICT
        if code in _THROTTLE_CODES or status >= 500 or status == 429:
            return TRANSIENT
        return PERMANENT
    if isinstance(exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError):
        return PERMANENT
    if isinstance(exc, _CONNECTION_ERRORS):
        return TRANSIENT
    return PERMANENT


class RetryableConflict(Exception):
    """A 409 on a single PUT: another conditional write of the key is in flight; ask again."""


class Retrier:
    """Runs one S3 request with retries of transient errors; raises store errors otherwise."""

    def __init__(self, config: S3TransferConfig, bucket: str, prefix: str, seed: int | None = None):
        self.config = config
        self.bucket = bucket
        self.prefix = prefix
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.retries = 0  # transient errors absorbed (for tests and metrics)

    def backoff(self, attempt: int) -> float:
        with self._lock:
            return self._random.uniform(
                0, min(self.config.backoff_cap, self.config.backoff_base * 2**attempt)
            )

    def call(self, what: str, key: str, fn: Callable[[], T], passthrough: tuple[str, ...] = ()) -> T:
        """``fn()``; errors whose class is in ``passthrough`` are re-raised for the caller to handle."""
        for attempt in range(self.config.max_attempts):
            try:
                return fn()
            except Exception as exc:
                kind = classify(exc)
                if kind in passthrough:
                    raise
                if kind != TRANSIENT:
                    raise self.permanent(what, key, exc) from exc
                if attempt + 1 == self.config.max_attempts:
                    code, status = error_code(exc)
                    raise TransientStoreError(
                        f"S3 {what} s3://{self.bucket}/{key} still failing after {attempt + 1} tries: "
                        f"{code} {status or ''} {exc} (bucket {self.bucket}, key prefix {self.prefix!r})"
                    ) from exc
                with self._lock:
                    self.retries += 1
                time.sleep(self.backoff(attempt))
        raise AssertionError("unreachable")

    def permanent(self, what: str, key: str, exc: BaseException) -> PermanentStoreError:
        code, status = error_code(exc)
        cause = _CAUSES.get(code, f"{code} (HTTP {status})" if status else code)
        return PermanentStoreError(
            f"S3 {what} failed permanently: {cause}. bucket {self.bucket!r}, key prefix {self.prefix!r}, "
            f"key {key!r}: {exc}"
        )
