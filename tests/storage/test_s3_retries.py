"""Error classification and retries: pure parts, then injected S3 answers on the real server."""

from __future__ import annotations

import botocore.exceptions
import pytest

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.backends import PermanentStoreError, TransientStoreError
from hsx_extractor.storage.s3_client import (
    CONFLICT,
    NO_UPLOAD,
    NOT_FOUND,
    PERMANENT,
    PRECONDITION,
    TRANSIENT,
    Retrier,
    S3TransferConfig,
    classify,
)
from hsx_extractor.storage.store import open_store
from hsx_extractor.tools.verify import run_verify
from tests.ground.s3 import S3Server
from tests.storage.faultproxy import FaultPlan, FaultProxy, Injection
from tests.storage.samples import plan_for, write_run


def _client_error(status: int, code: str) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (412, "PreconditionFailed", PRECONDITION),
        (409, "ConditionalRequestConflict", CONFLICT),
        (404, "NoSuchUpload", NO_UPLOAD),
        (404, "NoSuchKey", NOT_FOUND),
        (404, "404", NOT_FOUND),
        (404, "NoSuchBucket", PERMANENT),
        (403, "AccessDenied", PERMANENT),
        (403, "InvalidAccessKeyId", PERMANENT),
        (403, "SignatureDoesNotMatch", PERMANENT),
        (503, "SlowDown", TRANSIENT),
        (500, "InternalError", TRANSIENT),
        (429, "TooManyRequests", TRANSIENT),
        (400, "RequestTimeout", TRANSIENT),
        (400, "InvalidArgument", PERMANENT),
        (403, "RequestTimeTooSkewed", PERMANENT),  # the clock is wrong on every retry too
    ],
)
def test_s3_errors_are_classified(status: int, code: str, kind: str) -> None:
    assert classify(_client_error(status, code)) == kind


def test_connection_failures_are_transient_and_missing_credentials_permanent() -> None:
    assert classify(botocore.exceptions.EndpointConnectionError(endpoint_url="http://x")) == TRANSIENT
    assert classify(botocore.exceptions.ConnectionClosedError(endpoint_url="http://x")) == TRANSIENT
    assert classify(botocore.exceptions.ReadTimeoutError(endpoint_url="http://x")) == TRANSIENT
    assert classify(botocore.exceptions.NoCredentialsError()) == PERMANENT


def _retrier(attempts: int = 4) -> Retrier:
    config = S3TransferConfig(max_attempts=attempts, backoff_base=0.001, backoff_cap=0.002)
    return Retrier(config, "bkt", "team/out", seed=1)


def test_transient_errors_are_retried_until_success() -> None:
    failures = [_client_error(503, "SlowDown"), botocore.exceptions.ConnectionClosedError(endpoint_url="u")]
    retrier = _retrier()

    def flaky() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    assert retrier.call("PutObject", "k", flaky) == "done"
    assert retrier.retries == 2


def test_retries_run_out_with_a_transient_store_error() -> None:
    calls = []

    def always_busy() -> None:
        calls.append(1)
        raise _client_error(503, "SlowDown")

    with pytest.raises(TransientStoreError, match="still failing after 4 tries") as info:
        _retrier(4).call("PutObject", "team/out/k", always_busy)
    assert len(calls) == 4 and "bkt" in str(info.value) and "team/out" in str(info.value)
    assert info.value.exit_code == 1


def test_permanent_errors_fail_at_once_naming_bucket_prefix_and_cause() -> None:
    calls = []

    def denied() -> None:
        calls.append(1)
        raise _client_error(403, "AccessDenied")

    with pytest.raises(PermanentStoreError) as info:
        _retrier().call("PutObject", "team/out/k", denied)
    assert calls == [1]
    message = str(info.value)
    assert "access denied" in message and "'bkt'" in message and "'team/out'" in message
    assert info.value.exit_code == 3


def test_backoff_is_jittered_and_capped() -> None:
    retrier = Retrier(S3TransferConfig(backoff_base=0.1, backoff_cap=2.0), "b", "p", seed=3)
    sleeps = [retrier.backoff(n) for n in range(12)]
    assert all(0 <= s <= min(2.0, 0.1 * 2**n) for n, s in enumerate(sleeps))
    assert len(set(sleeps)) == len(sleeps)


def _spec(endpoint: str, bucket: str) -> OutputSpec:
    return OutputSpec.model_validate(
        {
            "uri": f"s3://{bucket}/inj",
            "endpoint": endpoint,
            "pathStyle": True,
            "partSizeBytes": 5 << 20,
            "uploadConcurrency": 2,
            "compression": "none",
        }
    )


@pytest.mark.s3
@pytest.mark.parametrize(
    "injection",
    [
        Injection("POST", "uploadId=", 409, "ConditionalRequestConflict"),  # complete: restart the upload
        Injection("PUT", "partNumber=2", 404, "NoSuchUpload"),  # upload aborted under us: restart
        Injection("PUT", "partNumber=1", 503, "SlowDown", times=3),  # throttled: retried
    ],
    ids=["409-on-complete", "upload-vanished", "throttled-part"],
)
def test_injected_answers_end_in_one_committed_shard(
    s3_env: S3Server, s3_bucket: str, injection: Injection
) -> None:
    with FaultProxy(s3_env.endpoint, FaultPlan(seed=0, rate=0.0, injections=[injection])) as proxy:
        store = open_store(_spec(proxy.endpoint, s3_bucket), "run-1")
        write_run(store, plan_for(40, 40), hidden=1024)  # ~11 MB: three parts
        assert injection.times == 0, proxy.counts
    report = run_verify(f"s3://{s3_bucket}/inj/run-1", output=_spec(s3_env.endpoint, s3_bucket))
    assert report.ok and report.samples_checked == 40, report.summary_text()
    assert s3_env.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


@pytest.mark.s3
def test_access_denied_mid_upload_fails_at_once_and_leaves_no_upload(
    s3_env: S3Server, s3_bucket: str
) -> None:
    injection = Injection("PUT", "partNumber=", 403, "AccessDenied", times=100)
    with FaultProxy(s3_env.endpoint, FaultPlan(seed=0, rate=0.0, injections=[injection])) as proxy:
        store = open_store(_spec(proxy.endpoint, s3_bucket), "run-1")
        with pytest.raises(PermanentStoreError, match="access denied") as info:
            write_run(store, plan_for(40, 40), hidden=1024)
        assert s3_bucket in str(info.value) and "'inj'" in str(info.value)
        assert injection.times >= 97  # at most one try per part in flight, no retries
    assert s3_env.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert open_store(_spec(s3_env.endpoint, s3_bucket), "run-1").committed_shards() == set()


@pytest.mark.s3
def test_a_read_timeout_is_retried(s3_env: S3Server, s3_bucket: str) -> None:
    """The first GET answers later than the client's read timeout; the retry succeeds."""
    from hsx_extractor.storage.s3 import S3Backend
    from hsx_extractor.storage.s3_client import S3Endpoint, make_client

    s3_env.client().put_object(Bucket=s3_bucket, Key="k/obj", Body=b"payload")
    slow_get = Injection("GET", "k/obj", times=1, delay_seconds=2.0)
    with FaultProxy(s3_env.endpoint, FaultPlan(seed=0, rate=0.0, injections=[slow_get])) as proxy:
        config = S3TransferConfig(read_timeout=0.5, backoff_base=0.01)
        spec = _spec(proxy.endpoint, s3_bucket)
        backend = S3Backend(make_client(S3Endpoint.of(spec), config), s3_bucket, config, "k")
        assert backend.get("k/obj", 1 << 20) == b"payload"
        assert slow_get.times == 0 and backend.retrier.retries == 1


@pytest.mark.s3
def test_a_skewed_clock_fails_at_once_saying_so(s3_env: S3Server, s3_bucket: str) -> None:
    """RequestTimeTooSkewed: every retry would be signed with the same wrong clock. One try, then a
    permanent error that says to fix the clock (not minutes of backoff ending in a 'transient')."""
    skewed = Injection("PUT", "plan.json", 403, "RequestTimeTooSkewed", times=100)
    with FaultProxy(s3_env.endpoint, FaultPlan(seed=0, rate=0.0, injections=[skewed])) as proxy:
        store = open_store(_spec(proxy.endpoint, s3_bucket), "run-1")
        with pytest.raises(PermanentStoreError, match="clock") as info:
            store.put_json_if_absent("plan.json", {"a": 1})
    assert skewed.times == 99, proxy.counts  # one try, no retry
    assert info.value.exit_code == 3 and "RequestTimeTooSkewed" in str(info.value)


@pytest.mark.s3
def test_a_lease_created_but_its_reply_lost_is_still_ours(s3_env: S3Server, s3_bucket: str) -> None:
    """The create of a lease (and of the startup probe's object) lands, its reply is lost and the retry
    is refused 412: the object holds this process's name, so the lease is its own, not a failed probe
    that stops the run (CI saw exit 3 through the R2 fault proxy) nor a shard left unheld for a lease."""
    from hsx_extractor.run.leases import Leases

    probe, claim = "shard-999999/", "shard-000003/g000000"
    lost = [Injection("PUT", target, reset_after=True) for target in (probe, claim)]
    with FaultProxy(s3_env.endpoint, FaultPlan(seed=0, rate=0.0, injections=lost)) as proxy:
        store = open_store(_spec(proxy.endpoint, s3_bucket), "run-1")
        mine = Leases(store, "r0", "aa")
        mine.probe()
        assert lost[0].times == 0, proxy.counts
        assert mine.claim(3) and 3 in mine.held
        assert lost[1].times == 0, proxy.counts
        assert not Leases(store, "r1", "bb").claim(3)  # and nobody else's
    assert proxy.counts["injected reset_after"] == 2, proxy.counts
