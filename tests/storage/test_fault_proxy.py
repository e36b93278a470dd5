"""A full shard-writing run through a proxy that breaks ~10% of requests; verify must pass."""

from __future__ import annotations

import pytest

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.store import open_store
from hsx_extractor.tools.verify import run_verify
from tests.ground.s3 import S3Server
from tests.storage.faultproxy import FAULTS, FaultPlan, FaultProxy
from tests.storage.samples import finalize_run, plan_for, write_run

pytestmark = pytest.mark.s3
SEED = 20261202


@pytest.mark.parametrize("compression", ["none", "bf16-zstd"])
def test_run_completes_through_faults_and_verifies(
    s3_env: S3Server, s3_bucket: str, compression: str
) -> None:
    print(f"fault proxy seed {SEED}")
    plan = FaultPlan(seed=SEED, rate=0.1, faults=FAULTS, slow_seconds=0.2)
    with FaultProxy(s3_env.endpoint, plan) as proxy:
        spec = OutputSpec.model_validate(
            {
                "uri": f"s3://{s3_bucket}/faulty",
                "endpoint": proxy.endpoint,
                "pathStyle": True,
                "partSizeBytes": 5 << 20,
                "uploadConcurrency": 3,
                "compression": compression,
            }
        )
        store = open_store(spec, "run-1")
        # 3 shards of ~11 MB raw: multipart uploads, plus small shards with single PUTs.
        write_run(store, plan_for(120, 40), hidden=1024, quarantine=frozenset({7}))
        # ... and 20 small shards (single PUTs, many commit records).
        write_run(open_store(spec, "run-2"), plan_for(60, 3), hidden=64)
        manifest = finalize_run(store, {"model": "tiny"})
        assert manifest is not None and manifest["samples"] == 119
        report = run_verify(f"s3://{s3_bucket}/faulty/run-1", output=spec)
        sampled = run_verify(f"s3://{s3_bucket}/faulty/run-2", sample_fraction=0.5, output=spec)
        print(f"fault counts {dict(proxy.counts)}; store retries {store.backend.retrier.retries}")  # type: ignore[attr-defined]
    assert report.ok, report.summary_text()
    assert report.samples_checked == 119 and report.duplicates == 0
    assert sampled.ok and sampled.samples == 60 and sampled.samples_checked >= 20, sampled.summary_text()
    assert sum(proxy.counts[f] for f in FAULTS) >= 5, proxy.counts
    direct = spec.model_copy(update={"endpoint": s3_env.endpoint})
    clean = run_verify(f"s3://{s3_bucket}/faulty/run-1", output=direct)
    assert clean.ok and clean.samples_checked == 119, clean.summary_text()
    assert run_verify(f"s3://{s3_bucket}/faulty/run-2", output=direct).samples_checked == 60
    assert s3_env.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
