"""Credentials without keys (issue 33, item 3): with no credentialsSecret, hsx's S3 client takes the SDK's
default chain, which is how EKS IRSA, GKE and Azure workload identity reach a pod (a projected token file,
a role, an STS endpoint). A whole extraction to the real S3 server with only a web-identity token, against a
small issuer on the test ground (tests/ground/sts.py); a token the issuer does not trust is a clear,
permanent failure before any sample is sent."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.run.runner import extract
from tests.ground.refserver import RefServer
from tests.ground.sts import web_identity_issuer
from tests.run.helpers import base_config, chat_rows, write_jsonl

pytestmark = [pytest.mark.s3]
ROLE = "arn:aws:iam::123456789012:role/hsx-extractor"


def only_web_identity(monkeypatch: pytest.MonkeyPatch, s3: Any, sts_endpoint: str, token_file: Path) -> None:
    """The environment a workload-identity webhook gives a pod: a role, a token file, no keys."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ROLE_ARN", ROLE)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts_endpoint)
    monkeypatch.setenv("AWS_REGION", s3.region)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to fall back on


def test_an_extraction_with_only_a_web_identity_token_writes_to_s3(
    tmp_path: Path, ref_server: RefServer, s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.projected-service-account-token")
    dataset = write_jsonl(tmp_path / "d.jsonl", chat_rows(5, words=8))
    output = {"uri": f"s3://{s3_bucket}/runs", "endpoint": s3_server.endpoint, "pathStyle": True}
    cfg = ExtractConfig.model_validate({**base_config(tmp_path, ref_server, dataset), "output": output})
    with web_identity_issuer(token.read_text(), ROLE, s3_server.access_key, s3_server.secret_key) as issuer:
        only_web_identity(monkeypatch, s3_server, issuer.endpoint, token)
        code, result = asyncio.run(extract(cfg))
        assert code == EXIT_OK and result is not None and result.manifest is not None
        assert result.manifest["samples"] == 5
        # The SDK asked the issuer with the pod's token and role, and nothing else gave it keys.
        assert issuer.calls and all(c["WebIdentityToken"] == token.read_text() for c in issuer.calls)
        assert all(c["RoleArn"] == ROLE for c in issuer.calls)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="runs/")["Contents"]]
    assert f"runs/{cfg.runId}/manifest.json" in keys and any("/shards/" in k for k in keys), keys

    # A token the issuer does not trust: the run stops at the store's probe, permanent, and says why.
    token.write_text("a-token-from-another-cluster")
    with web_identity_issuer("the-trusted-token", ROLE, s3_server.access_key, s3_server.secret_key) as issuer:
        only_web_identity(monkeypatch, s3_server, issuer.endpoint, token)
        again = cfg.model_copy(update={"runId": "untrusted"})
        code, result = asyncio.run(extract(again))
        assert code == EXIT_PERMANENT and result is None
        assert issuer.calls
    said = capsys.readouterr()
    error = next(line for line in (said.out + said.err).splitlines() if line.startswith("hsx extract: error:"))
    assert "InvalidIdentityToken" in error and "AssumeRoleWithWebIdentity" in error, error
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="runs/untrusted/")
    assert listed.get("KeyCount", 0) == 0, listed
