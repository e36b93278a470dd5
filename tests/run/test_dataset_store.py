"""The dataset is read from its own store: its endpoint, region, path style and credentials, the
output's only where the dataset leaves them unset."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import DATASET_CREDENTIALS_ENV, EXIT_OK
from hsx_extractor.run.dataset import dataset_endpoint
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.runner import extract
from hsx_extractor.storage.s3_client import S3Endpoint
from hsx_extractor.tools.verify import run_verify
from tests.ground.s3 import start_s3_server
from tests.run.helpers import RefServer, base_config, chat_rows, write_jsonl

OUTPUT = {"uri": "s3://out-bucket/p", "endpoint": "http://out:1", "region": "eu-1", "pathStyle": True}


def _cfg(dataset: dict[str, Any]) -> ExtractConfig:
    return ExtractConfig.model_validate(
        {"runId": "r", "dataset": {"uri": "s3://data/d.jsonl", **dataset}, "output": OUTPUT}
    )


def test_unset_dataset_settings_default_to_the_output() -> None:
    assert dataset_endpoint(_cfg({}), environ={}) == S3Endpoint("http://out:1", "eu-1", True, None)


def test_dataset_settings_win_and_its_credentials_come_from_its_own_variables() -> None:
    cfg = _cfg({"endpoint": "http://data:2", "region": "us-2", "pathStyle": False})
    env = dict(zip(DATASET_CREDENTIALS_ENV, ("AK", "SK", ""), strict=True))
    assert dataset_endpoint(cfg, environ=env) == S3Endpoint("http://data:2", "us-2", False, ("AK", "SK", None))
    # A key without its secret is no credential: the AWS chain decides, as for the output.
    assert dataset_endpoint(cfg, environ={DATASET_CREDENTIALS_ENV[0]: "AK"}).credentials is None


@pytest.mark.s3
@pytest.mark.slow
def test_dataset_on_one_store_output_on_another(
    tmp_path: Path, ref_server: RefServer, s3_env: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two real S3 servers with different credentials: the dataset on B, the shards on A (the AWS chain)."""
    rows = write_jsonl(tmp_path / "d.jsonl", chat_rows(12))
    with start_s3_server(tmp_path / "store-b") as store_b:
        data_bucket = store_b.create_bucket()
        store_b.client().upload_file(str(rows), data_bucket, "sets/chat.jsonl")
        for name, value in zip(DATASET_CREDENTIALS_ENV, (store_b.access_key, store_b.secret_key), strict=False):
            monkeypatch.setenv(name, value)
        cfg = base_config(
            tmp_path,
            ref_server,
            rows,
            run_id="two-stores",
            dataset__uri=f"s3://{data_bucket}/sets/chat.jsonl",
            dataset__endpoint=store_b.endpoint,
            output__uri=f"s3://{s3_bucket}/out",
            output__endpoint=s3_env.endpoint,
            output__pathStyle=True,
        )
        config = ExtractConfig.model_validate(cfg)
        code, result = asyncio.run(extract(config, Progress(config.runId, 0)))
    assert code == EXIT_OK and result is not None and result.manifest is not None
    assert result.manifest["samples"] == 12
    report = run_verify(f"s3://{s3_bucket}/out/two-stores")
    assert report.ok and report.samples_checked == 12, report.summary_text()
