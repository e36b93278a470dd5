"""A slow store never fills the pod's scratch (issue 32, item 4): the engine opens a new shard only while
fewer than ``output.maxOpenShards`` are open (being filled, or sealed and waiting to upload), so the spool
files on /scratch stay at that many whatever the store's speed. Measured from outside the engine: the
process's open spool files (``/proc/self/fd``), polled while a run writes through an S3 proxy that makes
every shard upload slow."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench.common import SpoolWatch
from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK
from hsx_extractor.run.runner import extract
from tests.storage.faultproxy import FaultPlan, FaultProxy

from .helpers import RefServer, base_config, chat_rows, write_jsonl

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def run_through_slow_store(tmp_path: Path, ref_server: RefServer, proxy: FaultProxy, bucket: str, max_open: int) -> SpoolWatch:
    dataset = write_jsonl(tmp_path / f"d{max_open}.jsonl", chat_rows(160, words=30))
    output = {"uri": f"s3://{bucket}/bound-{max_open}", "endpoint": proxy.endpoint, "pathStyle": True,
              "shardTargetBytes": 1 << 20, "compression": "none", "maxOpenShards": max_open}  # fmt: skip
    cfg = ExtractConfig.model_validate({**base_config(tmp_path, ref_server, dataset), "output": output})
    with SpoolWatch() as watch:
        code, result = asyncio.run(extract(cfg))
    assert code == EXIT_OK and result is not None and result.manifest is not None
    assert len(result.manifest["shards"]) >= 5, result.manifest["shards"]
    return watch


def test_spool_files_stay_at_max_open_shards_when_the_store_is_slow(
    tmp_path: Path, ref_server: RefServer, s3_env: Any, s3_bucket: str
) -> None:
    # Each shard upload waits 2 s at the proxy: the store keeps up with ~2 shards/s of the 4 seal threads,
    # the extraction fills one every ~0.3 s.
    with FaultProxy(s3_env.endpoint, FaultPlan(seed=1, rate=0.0, slow_matching="/shards/", slow_seconds=2.0)) as proxy:
        bounded = run_through_slow_store(tmp_path, ref_server, proxy, s3_bucket, max_open=2)
        loose = run_through_slow_store(tmp_path, ref_server, proxy, s3_bucket, max_open=64)
    print(f"spool files at once: bounded {bounded.peak_files} ({bounded.peak_bytes} B), loose {loose.peak_files}; "
          f"already open before: {len(bounded.before)}")
    assert 1 <= bounded.peak_files <= 2, bounded.peak_files
    # Each spool file holds about one shard (1 MiB target, the last sample may pass it).
    assert bounded.peak_bytes <= 2 * (1 << 20) * 1.25, bounded.peak_bytes
    # The measurement sees the backlog the bound removes: without it more shards wait on the slow store.
    assert loose.peak_files > 2, loose.peak_files
