"""The store on a local directory: commit protocol, resume, finalize, verify, reader."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx_extractor.config import OutputSpec
from hsx_extractor.reader import HiddenStatesDataset
from hsx_extractor.storage.backends import PermanentStoreError, ShardConflictError
from hsx_extractor.storage.commit_record import QuarantineEntry
from hsx_extractor.storage.shard_format import NonFiniteValues, SampleRecord
from hsx_extractor.storage.store import open_store
from hsx_extractor.storage.uris import open_uri_chunks
from hsx_extractor.tools.verify import run_verify
from tests.storage.samples import finalize_run, plan_for, record, seq_len_of, write_run


def _store(root: Path, compression: str = "bf16-zstd"):  # type: ignore[no-untyped-def]
    return open_store(OutputSpec.model_validate({"uri": str(root), "compression": compression}), "run-1")


@pytest.mark.parametrize("compression", ["none", "bf16-zstd"])
def test_full_run_round_trips_and_verifies(tmp_path: Path, compression: str) -> None:
    store = _store(tmp_path, compression)
    plan = plan_for(23, 5)
    commits = write_run(store, plan, quarantine=frozenset({3, 17}))
    assert store.committed_shards() == {0, 1, 2, 3, 4}
    assert sum(c.samples for c in commits) == 21 and sum(c.quarantined for c in commits) == 2
    manifest = finalize_run(store, {"model": "tiny", "captureLayers": [2, 4, 5], "tokenizerFingerprint": "ab" * 8})
    assert manifest is not None
    assert manifest["samples"] == 21 and manifest["quarantined"] == 2
    assert [q["index"] for q in manifest["quarantine"]] == [3, 17]
    assert manifest["run"]["captureLayers"] == [2, 4, 5]
    if compression == "bf16-zstd":
        assert manifest["compression"]["ratio"] > 1.0
    report = run_verify(str(tmp_path / "run-1"))
    assert report.ok, report.summary_text()
    assert (report.samples, report.samples_checked, report.quarantined, report.duplicates) == (21, 21, 2, 0)
    assert report.manifest

    dataset = HiddenStatesDataset(str(tmp_path / "run-1"))
    assert len(dataset) == 21
    positions = [dataset.dataset_index(p) for p in range(len(dataset))]
    assert positions == [i for i in range(23) if i not in (3, 17)]
    item = dataset[5]
    expected = record(positions[5], seq_len_of(positions[5]))
    length = expected.seq_len
    assert set(item) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (length,)
    assert item["loss_mask"].shape == (length,)
    assert item["hidden_state"].dtype == torch.bfloat16 and item["hidden_state"].shape == (1, length, 64)
    assert item["aux_hidden_state"].shape == (1, length, 192)
    bits = item["aux_hidden_state"][0].view(torch.int16).numpy().view(np.uint16)
    assert bits.tobytes() == expected.aux_hidden_states.tobytes()
    assert item["input_ids"].tolist() == expected.input_ids.tolist()


@pytest.mark.parametrize("compression", ["none", "bf16-zstd", "fp8-e4m3"])
def test_samples_read_one_after_another_stay_their_own(tmp_path: Path, compression: str) -> None:
    # Stored bytes are read into one buffer kept per thread: what a read returned must not change
    # when the next read (longer, shorter, another shard) reuses that buffer.
    store = _store(tmp_path, compression)
    write_run(store, plan_for(9, 3))
    finalize_run(store, {"model": "tiny", "captureLayers": [2, 4, 5], "tokenizerFingerprint": "ab" * 8})
    dataset = HiddenStatesDataset(str(tmp_path / "run-1"))
    order = (4, 0, 8, 1, 5, 2, 7, 3, 6)  # lengths differ; shards interleave
    held = [dataset[p] for p in order]
    records = [dataset.reader.read(p) for p in order]
    for item, rec, p in zip(held, records, order, strict=True):
        expected = record(p, seq_len_of(p))
        assert rec.input_ids.tolist() == expected.input_ids.tolist()
        assert rec.loss_mask.tolist() == expected.loss_mask.tolist()
        assert item["input_ids"].tolist() == expected.input_ids.tolist()
        assert item["loss_mask"].tolist() == expected.loss_mask.tolist()
        if compression == "fp8-e4m3":  # lossy: the same sample decodes to the same values again
            again = dataset[p]
            assert torch.equal(item["aux_hidden_state"], again["aux_hidden_state"])
            continue
        bits = item["aux_hidden_state"][0].view(torch.int16).numpy().view(np.uint16)
        assert bits.tobytes() == expected.aux_hidden_states.tobytes()
        bits = item["hidden_state"][0].view(torch.int16).numpy().view(np.uint16)
        assert bits.tobytes() == expected.hidden_states.tobytes()


def test_resume_skips_committed_shards_and_each_sample_is_stored_once(tmp_path: Path) -> None:
    plan = plan_for(12, 4)
    store = _store(tmp_path)
    store.put_json_if_absent("plan.json", plan)
    first = store.open_shard(0, range(0, 4))
    for i in range(4):
        first.add(record(i, seq_len_of(i)))
    first.seal()
    half = store.open_shard(1, range(4, 8))  # the process dies while shard 1 is half built
    half.add(record(4, seq_len_of(4)))
    assert finalize_run(store, {}) is None
    resumed = _store(tmp_path)
    assert resumed.committed_shards() == {0}
    commits = write_run(resumed, plan)
    assert [c.shard_index for c in commits] == [1, 2]
    assert finalize_run(resumed, {}) is not None
    report = run_verify(str(tmp_path / "run-1"))
    assert report.ok and report.samples == 12 and report.duplicates == 0, report.summary_text()


def test_identical_second_writer_succeeds_and_different_one_fails_loudly(tmp_path: Path) -> None:
    plan = plan_for(3, 3)
    (first,) = write_run(_store(tmp_path), plan)
    key = tmp_path / first.key
    before = key.read_bytes()
    again = _store(tmp_path).open_shard(0, range(0, 3))
    for i in range(3):
        again.add(record(i, seq_len_of(i)))
    assert (
        again.seal().checksum
        == json.loads((tmp_path / "run-1/commits/shard-000000.json").read_text())["checksum"]
    )
    different = _store(tmp_path).open_shard(0, range(0, 3))
    for i in range(3):
        different.add(record(i, seq_len_of(i), seed=99))
    with pytest.raises(ShardConflictError, match="different content"):
        different.seal()
    assert key.read_bytes() == before
    assert [p.name for p in (tmp_path / "run-1" / "shards").iterdir()] == [key.name]  # the loser's is gone


def noisy(rec: SampleRecord, scale: float = 1e-2) -> SampleRecord:
    """The same sample (ids, mask) with other hidden states, as a GPU rerun gives them."""
    shift = np.asarray(scale, dtype=rec.hidden_states.dtype)
    return dataclasses.replace(rec, hidden_states=rec.hidden_states + shift, aux_hidden_states=rec.aux_hidden_states - shift)


def test_a_second_writer_with_other_states_of_the_same_samples_adopts_the_committed_shard(tmp_path: Path) -> None:
    plan = plan_for(3, 3)
    (first,) = write_run(_store(tmp_path), plan)
    before = (tmp_path / first.key).read_bytes()
    rerun = _store(tmp_path).open_shard(0, range(0, 3))
    for i in range(3):
        rerun.add(noisy(record(i, seq_len_of(i))))
    adopted = rerun.seal()
    assert adopted == first and adopted.key == first.key  # the winner's record, not ours
    assert (tmp_path / first.key).read_bytes() == before
    assert [p.name for p in (tmp_path / "run-1" / "shards").iterdir()] == [Path(first.key).name]  # ours deleted
    # Other token ids (one sample differs only there) are other samples: a conflict, as before.
    other = _store(tmp_path).open_shard(0, range(0, 3))
    for i in range(3):
        rec = record(i, seq_len_of(i))
        other.add(dataclasses.replace(rec, input_ids=rec.input_ids[::-1].copy()) if i == 1 else rec)
    with pytest.raises(ShardConflictError, match="different content"):
        other.seal()
    # Another quarantine reason for a row is another shard too.
    quarantined = _store(tmp_path).open_shard(0, range(0, 3))
    for i in range(2):
        quarantined.add(noisy(record(i, seq_len_of(i))))
    quarantined.quarantine(QuarantineEntry(2, "row-2", "too_long", "longer than maxLength"))
    with pytest.raises(ShardConflictError):
        quarantined.seal()


def test_killed_between_object_and_record_then_different_bytes_on_restart(tmp_path: Path) -> None:
    """GPU reruns need not be bit-identical: the restart's shard commits under its own key and
    finalize removes the object of the killed attempt."""
    plan = plan_for(4, 2)
    store = _store(tmp_path)
    store.put_json_if_absent("plan.json", plan)
    killed = store.open_shard(1, range(2, 4))
    for i in (2, 3):
        killed.add(record(i, seq_len_of(i), seed=99))
    orphan = killed.seal()
    (tmp_path / "run-1" / "commits" / "shard-000001.json").unlink()  # died before the record
    restarted = _store(tmp_path)
    commits = write_run(restarted, plan)
    assert {c.shard_index for c in commits} == {0, 1}
    assert commits[1].key != orphan.key
    assert run_verify(str(tmp_path / "run-1")).warnings  # the orphan is noticed before finalize
    assert finalize_run(restarted, {}) is not None
    assert not (tmp_path / orphan.key).exists() and (tmp_path / commits[1].key).exists()
    report = run_verify(str(tmp_path / "run-1"))
    assert report.ok and not report.warnings and report.samples_checked == 4, report.summary_text()


def test_builder_refuses_bad_use(tmp_path: Path) -> None:
    store = _store(tmp_path)
    builder = store.open_shard(0, range(10, 13))
    with pytest.raises(ValueError, match="outside"):
        builder.add(record(9, 4))
    builder.add(record(10, 4))
    with pytest.raises(ValueError, match="already"):
        builder.quarantine(QuarantineEntry(10, "row-10", "no_dump", "x"))
    with pytest.raises(ValueError, match="neither added nor quarantined"):
        builder.seal()
    builder.abort()
    with pytest.raises(RuntimeError):
        builder.add(record(11, 4))
    with pytest.raises(ValueError):
        store.open_shard(1, range(5, 5))


@pytest.mark.parametrize("compression", ["none", "bf16-zstd", "fp8-e4m3"])
def test_a_sample_with_inf_or_nan_is_refused_and_nothing_of_it_is_stored(tmp_path: Path, compression: str) -> None:
    store = _store(tmp_path, compression)
    store.put_json_if_absent("plan.json", plan_for(3, 3))
    builder = store.open_shard(0, range(0, 3))
    builder.add(record(0, 5))
    bad = record(1, 5)
    bad.aux_hidden_states[2, 7], bad.hidden_states[4, 0] = 0x7FC0, 0xFF80  # NaN, -Inf
    with pytest.raises(NonFiniteValues, match=r"^2 Inf/NaN values$") as refused:
        builder.add(bad)
    assert (refused.value.index, refused.value.count) == (1, 2)
    builder.quarantine(QuarantineEntry(1, "row-1", "non_finite", str(refused.value)))  # the row is still free
    builder.add(record(2, 5))
    commit = builder.seal()
    assert (commit.samples, commit.sample_indices, commit.quarantined) == (2, (0, 2), 1)
    finalize_run(store, {})
    assert run_verify(str(tmp_path / "run-1")).ok


def test_all_quarantined_shard_commits_empty(tmp_path: Path) -> None:
    store = _store(tmp_path)
    commits = write_run(store, plan_for(4, 2), quarantine=frozenset({2, 3}))
    assert (commits[1].samples, commits[1].quarantined) == (0, 2)
    finalize_run(store, {})
    assert run_verify(str(tmp_path / "run-1")).ok


def test_verify_and_reader_catch_a_flipped_bit(tmp_path: Path) -> None:
    store = _store(tmp_path)
    commits = write_run(store, plan_for(6, 3))
    finalize_run(store, {})
    shard = tmp_path / commits[1].key
    header = store.read_header(commits[1].key)
    data = bytearray(shard.read_bytes())
    data[header.data_start + header.samples[1].offset + 3] ^= 0x10
    shard.write_bytes(bytes(data))
    report = run_verify(str(tmp_path / "run-1"))
    assert not report.ok and any("checksum mismatch" in e for e in report.errors), report.summary_text()
    sampled = run_verify(str(tmp_path / "run-1"), sample_fraction=1.0)
    assert not sampled.ok
    dataset = HiddenStatesDataset(str(tmp_path / "run-1"))
    with pytest.raises(ValueError, match="checksum"):
        dataset[4]
    unchecked = HiddenStatesDataset(str(tmp_path / "run-1"), verify_checksums=False)
    assert unchecked[0]["input_ids"].shape[0] == seq_len_of(0)


def test_verify_catches_manifest_and_commit_disagreement(tmp_path: Path) -> None:
    store = _store(tmp_path)
    write_run(store, plan_for(4, 2))
    finalize_run(store, {})
    path = tmp_path / "run-1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["samples"] = 5
    path.write_text(json.dumps(manifest))
    report = run_verify(str(tmp_path / "run-1"))
    assert any("manifest field 'samples'" in e for e in report.errors)
    (tmp_path / "run-1" / "commits" / "shard-000001.json").unlink()
    report = run_verify(str(tmp_path / "run-1"))
    assert any("no commit record" in e for e in report.errors)


def test_reader_requires_a_finished_run_unless_told(tmp_path: Path) -> None:
    store = _store(tmp_path)
    write_run(store, plan_for(4, 2))
    with pytest.raises(PermanentStoreError, match="manifest"):
        HiddenStatesDataset(str(tmp_path / "run-1"))
    assert len(HiddenStatesDataset(str(tmp_path / "run-1"), require_manifest=False)) == 4


def test_put_json_if_absent_returns_what_is_stored(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.put_json_if_absent("plan.json", {"shards": [], "n": 1}) == {"shards": [], "n": 1}
    assert store.put_json_if_absent("plan.json", {"shards": [], "n": 2}) == {"shards": [], "n": 1}
    assert store.get_json("missing.json") is None


def test_open_uri_chunks_reads_local_files(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id": 2}\n')
    assert list(open_uri_chunks(str(path), chunk_size=8)) == [b'{"id": 1', b'}\n{"id":', b" 2}\n"]
    assert b"".join(open_uri_chunks(f"file://{path}")) == b'{"id": 1}\n{"id": 2}\n'


def test_a_reused_spool_file_holds_only_the_new_shard(tmp_path: Path) -> None:
    store = _store(tmp_path, "none")
    store.put_json_if_absent(
        "plan.json", {"shards": [{"index": 0, "start": 0, "stop": 2}, {"index": 1, "start": 2, "stop": 3}]}
    )
    first = store.open_shard(0, range(0, 2))
    spool = first._fd
    first.add(record(0, 60))
    first.add(record(1, 60))
    first.seal()
    second = store.open_shard(1, range(2, 3))
    assert second._fd == spool  # the same file, longer than this shard needs
    second.add(record(2, 3))
    commit = second.seal()
    assert commit.bytes_stored < 3 * 64 * 4 * 2 + 4096  # none of shard 0's bytes ride along
    finalize_run(store, {})
    report = run_verify(str(tmp_path / "run-1"))
    assert report.ok and report.samples_checked == 3, report.summary_text()
    late = store.open_shard(1, range(2, 3))
    late_fd = late._fd
    store.close()
    late.abort()  # after the store closed: its file is closed, not kept
    with pytest.raises(OSError):
        os.fstat(late_fd)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_an_output_directory_the_writer_cannot_write_fails_at_open_naming_the_fix(tmp_path: Path) -> None:
    # As in the pod: the kubelet's hostPath directory is not the extractor's, and no capability
    # (DAC_OVERRIDE) lets it write anyway. Here root without capabilities, in its own 0555 directory.
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    code = (
        "from hsx_extractor.config import OutputSpec; from hsx_extractor.storage.store import open_store; "
        f"open_store(OutputSpec.model_validate({{'uri': {str(out)!r}}}), 'r1', writing=WRITING)"
    )
    capless = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]

    def run(writing: bool) -> subprocess.CompletedProcess[str]:
        argv = [*capless, sys.executable, "-c", code.replace("WRITING", str(writing))]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    refused = run(True)
    assert refused.returncode != 0 and "PermanentStoreError" in refused.stderr, refused.stderr
    assert f"output directory {out}/r1 is not writable by this process (uid 0, gid 0)" in refused.stderr
    assert "install -d -o 0 -g 0 DIR" in refused.stderr
    assert run(False).returncode == 0  # readers (hsx verify, the trainer's dataset) write nothing


class _SharedProbe(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Says, in the worker, whether the hidden states it returns already live in shared memory."""

    def __init__(self, inner: HiddenStatesDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.inner[i]
        shared = item["hidden_state"].is_shared() and item["aux_hidden_state"].is_shared()
        return {**item, "shared": torch.tensor(shared)}


@pytest.mark.parametrize("compression", ["bf16-zstd", "none", "fp8-e4m3"])
def test_dataloader_workers_decode_into_shared_memory(tmp_path: Path, compression: str) -> None:
    """In a DataLoader worker the states are decoded straight into shared memory (handed to the trainer
    without torch's copy) and equal what a read in the trainer's own process gives."""
    store = _store(tmp_path, compression)
    write_run(store, plan_for(6, 3), hidden=64)
    finalize_run(store, {})
    dataset = HiddenStatesDataset(str(tmp_path / "run-1"))
    assert not dataset[0]["hidden_state"].is_shared()  # in process: plain memory
    loader = torch.utils.data.DataLoader(_SharedProbe(dataset), batch_size=None, num_workers=2)
    items = list(loader)
    assert [bool(item["shared"]) for item in items] == [True] * len(dataset)
    for i, item in enumerate(items):
        direct = dataset[i]
        for name in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"):
            assert item[name].dtype == direct[name].dtype and torch.equal(item[name], direct[name]), (i, name)


def test_the_manifest_lists_the_first_quarantined_rows_and_counts_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hsx_extractor.storage import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "QUARANTINE_LISTED", 7)  # the real cap is 1000: the same code path
    store = _store(tmp_path)
    quarantined = frozenset(range(2, 40, 2))  # 19 rows in 4 shards
    commits = write_run(store, plan_for(40, 4), quarantine=quarantined)
    manifest = finalize_run(store, {"model": "tiny"})
    assert manifest["quarantined"] == 19 and manifest["quarantineByReason"] == {"too_long": 19}
    assert [q["index"] for q in manifest["quarantine"]] == sorted(quarantined)[:7]
    from hsx_extractor.tools import verify as verify_module
    from hsx_extractor.tools.runs import describe

    shown = describe(str(tmp_path / "run-1"))
    assert shown["quarantineReasons"][0]["count"] == 19 and shown["quarantineReasons"][0]["examples"]
    monkeypatch.setattr(verify_module, "QUARANTINE_LISTED", 7)
    assert run_verify(str(tmp_path / "run-1")).ok
    # A manifest written before quarantineByReason lists every row: still verified; a wrong count is not.
    path = tmp_path / "run-1" / "manifest.json"
    older = {k: v for k, v in manifest.items() if k != "quarantineByReason"}
    older["quarantine"] = [q.to_json() for c in commits for q in c.quarantine]
    assert len(older["quarantine"]) == 19
    path.write_text(json.dumps(older))
    assert run_verify(str(tmp_path / "run-1")).ok
    path.write_text(json.dumps({**manifest, "quarantineByReason": {"too_long": 18}}))
    report = run_verify(str(tmp_path / "run-1"))
    assert not report.ok and "quarantineByReason" in report.summary_text()


def test_a_writer_refuses_json_readers_would_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hsx_extractor.storage import store as store_module

    monkeypatch.setattr(store_module, "MAX_NAMED_JSON_BYTES", 1000)
    store = _store(tmp_path)
    with pytest.raises(PermanentStoreError, match="more than readers take"):
        store.put_json_if_absent("plan.json", {"shards": list(range(500))})
    assert store.get_json("plan.json") is None
