"""The store against a real S3 server (SeaweedFS, auth on)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.config import OutputSpec
from hsx_extractor.reader import HiddenStatesDataset
from hsx_extractor.run.sources import iter_rows
from hsx_extractor.storage.backends import PermanentStoreError, ShardConflictError
from hsx_extractor.storage.layout import InvalidKeyError
from hsx_extractor.storage.s3 import MultipartUploader, S3Backend
from hsx_extractor.storage.s3_client import S3Endpoint
from hsx_extractor.storage.spool import SpooledObject
from hsx_extractor.storage.store import open_store
from hsx_extractor.tools.verify import run_verify
from tests.ground.s3 import S3Server
from tests.storage.faultproxy import FaultPlan, FaultProxy
from tests.storage.samples import assert_same, finalize_run, plan_for, record, seq_len_of, write_run

pytestmark = pytest.mark.s3
REPO = Path(__file__).resolve().parents[2]


def _spec(server: S3Server, bucket: str, prefix: str = "team/out", **extra: object) -> OutputSpec:
    fields = {
        "uri": f"s3://{bucket}/{prefix}",
        "endpoint": server.endpoint,
        "pathStyle": True,
        "partSizeBytes": 5 << 20,
        "uploadConcurrency": 4,
        **extra,
    }
    return OutputSpec.model_validate(fields)


def _uploads(server: S3Server, bucket: str) -> list[dict]:
    return server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _has_parts(server: S3Server, bucket: str, upload: dict) -> bool:
    try:
        listed = server.client().list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    except Exception:  # completed or aborted meanwhile
        return False
    return bool(listed.get("Parts"))


def _big_source(seed: int = 0) -> SpooledObject:
    """A 12 MiB object (three 5 MiB parts) as the uploader sees a sealed shard."""
    import tempfile

    data = (bytes(range(256)) * 4096 * 12)[: 12 << 20]
    data = bytes([seed]) + data[1:]
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    os.pwrite(fd, data, 0)
    return SpooledObject(b"", fd, ((0, len(data)),))


@pytest.mark.parametrize("compression", ["none", "bf16-zstd"])
def test_round_trip_of_every_tensor_is_byte_exact(s3_env: S3Server, s3_bucket: str, compression: str) -> None:
    spec = _spec(s3_env, s3_bucket, compression=compression)
    store = open_store(spec, "run-1")
    write_run(store, plan_for(14, 5), hidden=256, quarantine=frozenset({6}))
    manifest = finalize_run(store, {"model": "tiny"})
    assert manifest is not None and manifest["samples"] == 13
    run_uri = f"s3://{s3_bucket}/team/out/run-1"
    report = run_verify(run_uri, output=spec)
    assert report.ok and report.samples_checked == 13, report.summary_text()
    assert run_verify(run_uri, sample_fraction=0.3, output=spec).ok
    dataset = HiddenStatesDataset(run_uri, output=spec)
    reader = dataset.reader
    # Held together: each read reuses one buffer, and no sample may change under the next read.
    got_all = [reader.read(position) for position in range(len(dataset))]
    for got in got_all:
        assert_same(got, record(got.index, seq_len_of(got.index), 256))
    assert len(dataset) == 13
    key = store.shard_object_key(0)
    size = store.backend.size(key)
    assert size is not None
    tail = store.backend.get_range_into(key, size - 3, memoryview(bytearray(10)))
    assert bytes(tail) == store.backend.get_range(key, size - 3, 3) and len(tail) == 3  # what exists
    assert _uploads(s3_env, s3_bucket) == []


def seal_at_once(builders: list[Any]) -> list[object]:
    """Seal every builder from its own thread, released together; each result or exception."""
    results: list[object] = [None] * len(builders)
    start = threading.Barrier(len(builders))

    def seal(slot: int) -> None:
        start.wait()
        try:
            results[slot] = builders[slot].seal()
        except Exception as exc:
            results[slot] = exc

    threads = [threading.Thread(target=seal, args=(n,)) for n in range(len(builders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_two_writers_racing_on_one_shard(s3_env: S3Server, s3_bucket: str) -> None:
    """Both seal the same shard at once: one object, one commit record, both report success."""
    spec = _spec(s3_env, s3_bucket)
    builders = []
    for _ in range(2):
        b = open_store(spec, "race").open_shard(0, range(0, 40))
        for i in range(40):
            b.add(record(i, seq_len_of(i), 256))
        builders.append(b)
    results = seal_at_once(builders)
    assert all(not isinstance(r, Exception) for r in results), results
    assert results[0] == results[1]
    client = s3_env.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert sorted(keys) == ["team/out/race/commits/shard-000000.json", results[0].key]  # type: ignore[attr-defined]
    assert _uploads(s3_env, s3_bucket) == []


def test_two_writers_whose_quarantine_details_differ_agree(s3_env: S3Server, s3_bucket: str) -> None:
    """Issue 14 item 4: a duplicate pod quarantines the same row for the same reason, but the
    free-text detail names its own request id. Same content: both succeed, one record."""
    from hsx_extractor.storage.commit_record import QuarantineEntry

    spec = _spec(s3_env, s3_bucket)
    results = []
    for rid in ("rid-of-pod-a", "rid-of-pod-b"):
        b = open_store(spec, "dup").open_shard(0, range(0, 10))
        for i in range(10):
            if i == 3:
                b.quarantine(QuarantineEntry(3, "s3", "server_error", f"rid {rid}: error marker"))
            else:
                b.add(record(i, seq_len_of(i), 64))
        results.append(b.seal())
    assert results[0].content() == results[1].content()
    stored_commit = open_store(spec, "dup", writing=False).get_commit(0)
    assert stored_commit is not None and stored_commit.quarantine[0].detail == "rid rid-of-pod-a: error marker"
    # A different reason for the same row is a real conflict.
    b = open_store(spec, "dup").open_shard(0, range(0, 10))
    for i in range(10):
        if i == 3:
            b.quarantine(QuarantineEntry(3, "s3", "no_dump", "rid rid-of-pod-c"))
        else:
            b.add(record(i, seq_len_of(i), 64))
    with pytest.raises(ShardConflictError):
        b.seal()


def test_two_writers_racing_with_different_content(s3_env: S3Server, s3_bucket: str) -> None:
    """Exactly one wins; the other gets the loud error and its object is discarded."""
    spec = _spec(s3_env, s3_bucket)
    builders = []
    for seed in (1, 2):
        b = open_store(spec, "race").open_shard(0, range(0, 30))
        for i in range(30):
            b.add(record(i, seq_len_of(i), 256, seed=seed))
        builders.append(b)
    results = seal_at_once(builders)
    winners = [r for r in results if not isinstance(r, Exception)]
    losers = [r for r in results if isinstance(r, ShardConflictError)]
    assert len(winners) == 1 and len(losers) == 1, results
    keys = sorted(o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == ["team/out/race/commits/shard-000000.json", winners[0].key]  # type: ignore[attr-defined]
    assert open_store(spec, "race").get_commit(0) == winners[0]


def test_conditional_multipart_completion_refuses_a_second_object(s3_env: S3Server, s3_bucket: str) -> None:
    """The uploader itself (no HEAD shortcut): the second complete gets 412, nothing is replaced."""
    backend = S3Backend.from_output(s3_bucket, _spec(s3_env, s3_bucket))
    uploader: MultipartUploader = backend.uploader
    first, second = _big_source(1), _big_source(2)
    assert uploader.upload_if_absent("k/obj", first, {}) is True
    assert uploader.upload_if_absent("k/obj", second, {}) is False
    body = s3_env.client().get_object(Bucket=s3_bucket, Key="k/obj")["Body"].read()
    assert body[:1] == b"\x01" and len(body) == first.size
    assert uploader.put_if_absent("k/small", b"one") is True
    assert uploader.put_if_absent("k/small", b"two") is False
    assert backend.get("k/small", 1 << 20) == b"one"
    assert _uploads(s3_env, s3_bucket) == []


def test_different_content_for_a_committed_shard_fails_loudly(s3_env: S3Server, s3_bucket: str) -> None:
    spec = _spec(s3_env, s3_bucket)
    write_run(open_store(spec, "run-1"), plan_for(3, 3), hidden=128)
    builder = open_store(spec, "run-1").open_shard(0, range(0, 3))
    for i in range(3):
        builder.add(record(i, seq_len_of(i), 128, seed=5))
    with pytest.raises(ShardConflictError, match="different content") as info:
        builder.seal()
    assert f"s3://{s3_bucket}/team/out/run-1/commits/shard-000000.json" in str(info.value)
    report = run_verify(f"s3://{s3_bucket}/team/out/run-1", output=spec)
    assert report.ok and not report.warnings, report.summary_text()


def test_wrong_credentials_fail_at_once_naming_the_cause(
    s3_env: S3Server, s3_bucket: str, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(PermanentStoreError) as info:
        open_store(_spec(s3_env, s3_bucket), "run-1")
    message = str(info.value)
    assert "secret key is wrong" in message and s3_bucket in message and "team/out" in message
    assert info.value.exit_code == 3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(PermanentStoreError, match="access key is unknown"):
        open_store(_spec(s3_env, s3_bucket), "run-1")


def test_missing_bucket_fails_at_once(s3_env: S3Server) -> None:
    with pytest.raises(PermanentStoreError, match="bucket does not exist") as info:
        open_store(_spec(s3_env, "no-such-bucket-here"), "run-1")
    assert "no-such-bucket-here" in str(info.value)


def test_a_store_that_honours_if_none_match_passes_the_probe(s3_env: S3Server, s3_bucket: str) -> None:
    open_store(_spec(s3_env, s3_bucket), "run-1")
    assert "Contents" not in s3_env.client().list_objects_v2(Bucket=s3_bucket)  # probe key removed


def test_a_store_that_ignores_if_none_match_is_refused(s3_env: S3Server, s3_bucket: str) -> None:
    """Issue 14 item 3: on such a store a duplicate writer silently overwrites a committed shard."""
    plan = FaultPlan(seed=0, rate=0.0, strip_if_none_match=True, secret_key=s3_env.secret_key)
    with FaultProxy(s3_env.endpoint, plan) as proxy:
        spec = _spec(s3_env, s3_bucket, endpoint=proxy.endpoint)
        with pytest.raises(PermanentStoreError, match="ignores conditional writes") as info:
            open_store(spec, "run-1")
        assert proxy.counts["stripped if-none-match"] == 2
        # Readers write nothing, so they do not probe: an existing run stays readable.
        assert open_store(spec, "run-1", writing=False).committed_shards() == set()
    message = str(info.value)
    assert proxy.endpoint in message and s3_bucket in message and "If-None-Match" in message
    assert info.value.exit_code == 3
    assert "Contents" not in s3_env.client().list_objects_v2(Bucket=s3_bucket)  # probe key removed


@pytest.mark.parametrize("prefix", ["team/../escape", "../up", "a/./b"])
def test_dot_dot_in_the_prefix_is_rejected(s3_env: S3Server, s3_bucket: str, prefix: str) -> None:
    with pytest.raises(InvalidKeyError):
        open_store(_spec(s3_env, s3_bucket, prefix=prefix), "run-1")
    assert "Contents" not in s3_env.client().list_objects_v2(Bucket=s3_bucket)


def test_writer_killed_mid_upload_then_restarted(s3_env: S3Server, s3_bucket: str) -> None:
    """SIGKILL while a shard is uploading; the restart commits every sample exactly once and
    leaves no multipart upload behind."""
    spec = _spec(s3_env, s3_bucket, compression="none", uploadConcurrency=1)
    env = {**os.environ, **s3_env.env(), "PYTHONPATH": str(REPO)}
    # Parts go through a proxy that delays each one, so the kill lands mid-upload.
    slow_parts = FaultPlan(seed=0, rate=0.0, slow_seconds=0.5, slow_matching="partNumber=")
    with FaultProxy(s3_env.endpoint, slow_parts) as proxy:
        killed_during = _run_and_kill(
            spec.model_copy(update={"endpoint": proxy.endpoint}), env, s3_env, s3_bucket
        )
    assert _uploads(s3_env, s3_bucket), "the kill should have left an unfinished upload"
    assert killed_during.startswith("team/out/killed/shards/")

    store = open_store(spec, "killed")
    before = store.committed_shards()
    write_run(store, plan_for(90, 30), hidden=1024)
    assert finalize_run(store, {}) is not None
    assert _uploads(s3_env, s3_bucket) == []
    indices = [i for k in sorted(store.committed_shards()) for i in store.get_commit(k).sample_indices]  # type: ignore[union-attr]
    assert indices == list(range(90))
    report = run_verify(f"s3://{s3_bucket}/team/out/killed", output=spec)
    assert report.ok and report.duplicates == 0 and report.samples_checked == 90, report.summary_text()
    assert before < store.committed_shards()


def _run_and_kill(spec: OutputSpec, env: dict[str, str], server: S3Server, bucket: str) -> str:
    """Start the writer process; SIGKILL it once an upload has a part. Returns that upload's key."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.storage.writer_proc", spec.model_dump_json(), "killed", "90", "30"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    killed_during = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            uploads = _uploads(server, bucket)
            if uploads and _has_parts(server, bucket, uploads[0]):
                os.kill(proc.pid, signal.SIGKILL)
                killed_during = uploads[0]["Key"]
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate(timeout=30)
    assert killed_during is not None, f"writer finished before it could be killed: {stderr.decode()[-2000:]}"
    return killed_during


def test_dataset_lines_from_s3(s3_env: S3Server, s3_bucket: str) -> None:
    rows = b"".join(
        json.dumps({"id": i, "input_ids": [1, 2], "loss_mask": [0, 1]}).encode() + b"\n" for i in range(5)
    )
    s3_env.client().put_object(Bucket=s3_bucket, Key="data/train.jsonl", Body=rows + b'{"id": "last"}')
    spec = _spec(s3_env, s3_bucket)
    got = list(iter_rows(f"s3://{s3_bucket}/data/train.jsonl", S3Endpoint.of(spec)))
    assert b"\n".join(r.data for r in got) == rows + b'{"id": "last"}' and len(got) == 6  # type: ignore[misc]
    with pytest.raises(PermanentStoreError):
        list(iter_rows(f"s3://{s3_bucket}/data/missing.jsonl", S3Endpoint.of(spec)))


def test_a_dataset_rewritten_while_it_is_read_stops_the_read_with_what_changed(s3_env: S3Server, s3_bucket: str) -> None:
    """Every ranged read of a dataset is pinned to the ETag it had when reading began (issue 32, item 6):
    an object rewritten in between is refused, JSONL (chunked reads) and Parquet (ranged reads) alike."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from hsx_extractor.storage import uris
    from hsx_extractor.storage.backends import ObjectChanged

    client, where = s3_env.client(), S3Endpoint.of(_spec(s3_env, s3_bucket))
    line = b'{"id": "%d", "messages": []}\n'
    client.put_object(Bucket=s3_bucket, Key="data/a.jsonl", Body=b"".join(line % i for i in range(4000)))
    chunks = uris.open_uri_chunks(f"s3://{s3_bucket}/data/a.jsonl", where, chunk_size=4096)
    first = next(chunks)
    client.put_object(Bucket=s3_bucket, Key="data/a.jsonl", Body=b"".join(line % (i + 1) for i in range(4000)))
    with pytest.raises(ObjectChanged, match="changed while it was read"):
        list(chunks)
    assert first.startswith(b'{"id": "0"')
    # Unchanged, the same reads go through.
    assert sum(len(c) for c in uris.open_uri_chunks(f"s3://{s3_bucket}/data/a.jsonl", where, 4096)) > 4096 * 10

    table = io.BytesIO()
    pq.write_table(pa.table({"id": [str(i) for i in range(100)]}), table)
    client.put_object(Bucket=s3_bucket, Key="data/b.parquet", Body=table.getvalue())
    source = uris.open_uri_source(f"s3://{s3_bucket}/data/b.parquet", where)
    assert source.read_at(0, 4) == b"PAR1"
    client.put_object(Bucket=s3_bucket, Key="data/b.parquet", Body=table.getvalue() + b"")
    client.put_object(Bucket=s3_bucket, Key="data/b.parquet", Body=b"PAR1" + table.getvalue()[4:-8] + b"\0" * 8)
    with pytest.raises(ObjectChanged):
        source.read_at(4, 4)


def test_reader_in_dataloader_workers(s3_env: S3Server, s3_bucket: str) -> None:
    """Each worker process opens its own client; the dataset also survives pickling (spawn)."""
    import pickle

    import torch.utils.data

    spec = _spec(s3_env, s3_bucket)
    store = open_store(spec, "loader")
    write_run(store, plan_for(10, 4), hidden=32)
    finalize_run(store, {})
    dataset = HiddenStatesDataset(f"s3://{s3_bucket}/team/out/loader", output=spec)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    lengths = [item["input_ids"].shape[0] for item in loader]
    assert lengths == [seq_len_of(i) for i in range(10)]
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone[3]["aux_hidden_state"].shape == (1, seq_len_of(3), 96)


def _commit_body(server: S3Server, bucket: str, key: str) -> dict[str, Any]:
    return json.loads(server.client().get_object(Bucket=bucket, Key=key)["Body"].read())  # type: ignore[no-any-return]


def test_reader_refuses_a_commit_record_naming_another_runs_shard(s3_env: S3Server, s3_bucket: str) -> None:
    """A record of run a that names run b's object (with b's checksum and size: b's data is intact
    and verifies sample by sample) must not make a reader of a serve b's samples."""
    spec = _spec(s3_env, s3_bucket, compression="none")
    for run, seed in (("run-a", 0), ("run-b", 1)):
        store = open_store(spec, run)
        write_run(store, plan_for(6, 3), hidden=16, seed=seed)
        finalize_run(store, {})
    record_key = "team/out/run-a/commits/shard-000000.json"
    theirs = _commit_body(s3_env, s3_bucket, "team/out/run-b/commits/shard-000000.json")
    body = {**_commit_body(s3_env, s3_bucket, record_key)}
    body.update(key=theirs["key"], checksum=theirs["checksum"], bytesStored=theirs["bytesStored"])
    s3_env.client().put_object(Bucket=s3_bucket, Key=record_key, Body=json.dumps(body).encode())
    with pytest.raises(ValueError, match=r"names key 'team/out/run-b/shards/.*not this run's"):
        HiddenStatesDataset(f"s3://{s3_bucket}/team/out/run-a", output=spec)


def test_reader_checks_the_shard_header_against_the_commit_record(s3_env: S3Server, s3_bucket: str) -> None:
    """Run a's shard object replaced by other, self-consistent bytes (b's shard of the same rows: the
    same size, every sample checksum valid). Only the header checksum in the commit record tells."""
    spec = _spec(s3_env, s3_bucket, compression="none")
    for run, seed in (("run-a", 0), ("run-b", 1)):
        store = open_store(spec, run)
        write_run(store, plan_for(6, 3), hidden=16, seed=seed)
        finalize_run(store, {})
    ours = _commit_body(s3_env, s3_bucket, "team/out/run-a/commits/shard-000000.json")
    theirs = _commit_body(s3_env, s3_bucket, "team/out/run-b/commits/shard-000000.json")
    assert ours["bytesStored"] == theirs["bytesStored"] and ours["checksum"] != theirs["checksum"]
    client = s3_env.client()
    client.copy_object(Bucket=s3_bucket, Key=ours["key"], CopySource={"Bucket": s3_bucket, "Key": theirs["key"]})
    dataset = HiddenStatesDataset(f"s3://{s3_bucket}/team/out/run-a", output=spec)
    with pytest.raises(ValueError, match=f"shard 0: header checksum {theirs['checksum']}, commit record says"):
        dataset[0]
    assert dataset[3]["input_ids"].shape[0] == seq_len_of(3)  # shard 1 is intact and still reads
