"""Hostile commit records and shards: a table of damaged or forged outputs, each with its outcome.

Anyone who can write the bucket can write anything into a run. For every case, ``hsx verify``
must end with a report naming the problem (exit 3, never a traceback) and the reader must raise a
clear ShardFormatError/PermanentStoreError (never RecursionError, OverflowError, MemoryError),
both in bounded time and memory. "Forged" cases rewrite a shard object and then its commit record
consistently (new header checksum, key and size), so only the structural checks can catch them.
"""

from __future__ import annotations

import json
import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash

from hsx_extractor.config import OutputSpec
from hsx_extractor.contract import EXIT_PERMANENT
from hsx_extractor.reader import OutputReader
from hsx_extractor.storage.backends import StoreError
from hsx_extractor.storage.shard_format import ShardFormatError
from hsx_extractor.storage.store import open_store
from hsx_extractor.tools.cli import main
from hsx_extractor.tools.verify import run_verify
from tests.storage.samples import finalize_run, plan_for, write_run

RUN = "run-1"
MEMORY_BOUND = 64 << 20  # bytes a case may allocate (Python heap and numpy), verify and reader together
TIME_BOUND = 20.0  # seconds, both together
DEEP = 100_000  # nesting levels: far past the interpreter's recursion limit


@dataclass
class Run:
    """A finished local run: 2 shards of 3 samples (shard 0 is the one spoiled)."""

    root: Path

    @property
    def uri(self) -> str:
        return str(self.root / RUN)

    def commit_path(self, k: int) -> Path:
        return self.root / RUN / "commits" / f"shard-{k:06d}.json"

    def commit(self, k: int = 0) -> dict[str, Any]:
        return json.loads(self.commit_path(k).read_text())  # type: ignore[no-any-return]

    def write_commit(self, body: dict[str, Any] | bytes | str, k: int = 0) -> None:
        path = self.commit_path(k)
        path.chmod(0o644)
        if isinstance(body, dict):
            body = json.dumps(body)
        path.write_bytes(body.encode() if isinstance(body, str) else body)

    def shard_path(self, k: int = 0) -> Path:
        return self.root / self.commit(k)["key"]


def _make_run(root: Path) -> Run:
    store = open_store(OutputSpec.model_validate({"uri": str(root), "compression": "bf16-zstd"}), RUN)
    write_run(store, plan_for(6, 3), hidden=64)
    finalize_run(store, {})
    store.close()
    return Run(root)


# ---- mutations -------------------------------------------------------------------------------------
Mutation = Callable[[Run], None]


def fields(**changes: Any) -> Mutation:
    """Set (or, with value ..., delete) fields of shard 0's commit record."""

    def apply(run: Run) -> None:
        body = run.commit()
        for name, value in changes.items():
            if value is ...:
                del body[name]
            else:
                body[name] = value
        run.write_commit(body)

    return apply


def raw_field(name: str, text: str) -> Mutation:
    """Replace a field's value in shard 0's record by raw JSON text (Infinity, 1e9, deep nesting)."""

    def apply(run: Run) -> None:
        body = run.commit()
        body[name] = "@@"
        run.write_commit(json.dumps(body).replace('"@@"', text))

    return apply


def raw_record(data: bytes) -> Mutation:
    return lambda run: run.write_commit(data)


def _split(data: bytes) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    return header, json.loads(header["__metadata__"]["hsx"]), data[8 + n :]


def forge(
    doc: Callable[[dict[str, Any]], str | None] | None = None,
    raw_header: bytes | None = None,
    bytes_stored: Callable[[int, dict[str, Any]], int] | None = None,  # (header bytes, index) -> size
) -> Mutation:
    """Rewrite shard 0's header (its hsx index ``doc``, or the whole JSON) and then its commit record
    to match: header checksum, content-addressed key, object size (or ``bytes_stored(header bytes,
    index)``)."""

    def apply(run: Run) -> None:
        old = run.shard_path()
        header, index, body = _split(old.read_bytes())
        if raw_header is None:
            text = doc(index) if doc else None
            header["__metadata__"]["hsx"] = text if text is not None else json.dumps(index)
            raw = json.dumps(header).encode()
        else:
            raw = raw_header
        raw += b" " * (-(8 + len(raw)) % 8)
        head = struct.pack("<Q", len(raw)) + raw
        checksum = xxhash.xxh3_64_hexdigest(head)
        commit = run.commit()
        key = re.sub(r"-[0-9a-f]{16}\.safetensors$", f"-{checksum}.safetensors", commit["key"])
        (run.root / key).write_bytes(head + body)
        old.chmod(0o644)
        old.unlink()
        size = len(head) + len(body)
        claimed = bytes_stored(len(head), index) if bytes_stored else size
        commit.update(key=key, checksum=checksum, bytesStored=claimed)
        run.write_commit(commit)

    return apply


def patch_object(offset: int, data: bytes) -> Mutation:
    """Overwrite bytes of shard 0's object in place (negative offset: from the end); no forging."""

    def apply(run: Run) -> None:
        path = run.shard_path()
        blob = bytearray(path.read_bytes())
        start = offset if offset >= 0 else len(blob) + offset
        blob[start : start + len(data)] = data
        path.chmod(0o644)
        path.write_bytes(bytes(blob))

    return apply


def last_sample(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(index: dict[str, Any]) -> None:
        edit(index["samples"][-1])

    return apply


def tensor(name: str, edit: Callable[[list[Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(sample: dict[str, Any]) -> None:
        edit(next(t for t in sample["tensors"] if t[0] == name))

    return last_sample(apply)


def _set(i: int, value: Any) -> Callable[[list[Any]], None]:
    def apply(t: list[Any]) -> None:
        t[i] = value

    return apply


def _enormous_but_consistent(sample: dict[str, Any]) -> None:
    """seqLen 2**20 at H=16384, every raw tensor the size its shape says: ~2**37 bytes of sample."""
    seq, hidden = 1 << 20, 16384
    sizes = {"input_ids": ("I32", [seq], 4 * seq), "loss_mask": ("U8", [seq], seq),
             "aux_hidden_states": ("BF16", [seq, 3 * hidden], 6 * seq * hidden),
             "hidden_states": ("BF16", [seq, hidden], 2 * seq * hidden)}
    offset = 0
    tensors = []
    for name in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states"):
        dtype, shape, length = sizes[name]
        tensors.append([name, dtype, shape, "raw", offset, length])
        offset += length
    sample.update(seqLen=seq, tensors=tensors, length=offset)


def _claimed_size(header_bytes: int, index: dict[str, Any]) -> int:
    """The object size the forged header claims (a consistent lie in the commit record)."""
    return header_bytes + sum(sample["length"] for sample in index["samples"])


def _deep_doc(_: dict[str, Any]) -> str:
    return "[" * DEEP + "]" * DEEP


def _doc_text(replace: str, by: str) -> Callable[[dict[str, Any]], str]:
    def apply(index: dict[str, Any]) -> str:
        text = json.dumps(index)
        assert replace in text
        return text.replace(replace, by, 1)

    return apply


def _compressed_huge(index: dict[str, Any]) -> None:
    for sample in index["samples"]:
        for t in sample["tensors"]:
            if t[3] == "bf16-split-zstd":
                t[2] = [1 << 20, 1 << 20]
                return
    raise AssertionError("no compressed tensor in shard 0")


def _duplicate_index(index: dict[str, Any]) -> None:
    index["samples"][1]["index"] = index["samples"][0]["index"]


def _fifth_tensor(sample: dict[str, Any]) -> None:
    sample["tensors"].append(["extra", "U8", [0], "raw", sample["length"], 0])


@dataclass(frozen=True)
class Case:
    name: str
    mutate: Mutation
    verify: str  # regex one of verify's errors must match
    reader: str  # regex the reader's error must match


DAMAGED = "commit record of shard 0 .* is damaged: "
CASES = [
    # ---- commit records --------------------------------------------------------------------------
    Case("checksum-zz", fields(checksum="zz"), DAMAGED + ".*checksum must be 16 lowercase hex", "checksum must be 16"),
    Case("checksum-upper", fields(checksum="ABCDEF0123456789"), "checksum must be 16 lowercase", "checksum must be 16"),
    Case("deep-record", raw_record(b"[" * DEEP + b"]" * DEEP), "commit record is nested too deeply", "nested too deeply"),
    Case("deep-field", raw_field("quarantined", "[" * DEEP + "]" * DEEP), "nested too deeply", "nested too deeply"),
    Case("infinity", raw_field("bytesStored", "Infinity"), "Infinity is not a JSON number", "Infinity is not"),
    Case("minus-infinity", raw_field("stop", "-Infinity"), "-Infinity is not a JSON number", "-Infinity is not"),
    Case("nan", raw_field("start", "NaN"), "NaN is not a JSON number", "NaN is not"),
    Case("stop-1e9-float", raw_field("stop", "1e9"), r"stop must be an integer .*got 1000000000\.0", "stop must be an integer"),
    Case("stop-1e9-int", fields(stop=10**9), r"do not cover \[0, 1000000000\) exactly", r"do not cover \[0, 1000000000\)"),
    Case("start-after-stop", fields(start=5), r"stop must be an integer in \[5,", r"stop must be an integer in \[5,"),
    Case("negative-start", fields(start=-1), r"start must be an integer in \[0,", r"start must be an integer in \[0,"),
    Case("index-as-string", fields(samples=["0", "1", "2"]), "sample index must be an integer", "sample index must be"),
    Case("index-as-bool", fields(samples=[False, True, 2]), "sample index must be an integer .* got False", "got False"),
    Case("indices-unsorted", fields(samples=[2, 1, 0]), "samples are not sorted and distinct", "not sorted"),
    Case("index-outside-range", fields(samples=[0, 1, 99]), r"sample index must be an integer in \[0, 2\]", r"in \[0, 2\]"),
    Case("quarantine-overlaps", fields(samples=[0, 1], quarantined=[{"index": 1, "reason": "x"}]), "do not cover", "do not cover"),
    Case("quarantine-not-object", fields(samples=[0, 1], quarantined=[2]), "quarantine entry must be a JSON object", "quarantine entry"),
    Case("huge-integer", fields(bytesStored=2**70), "bytesStored must be an integer in", "bytesStored must be"),
    Case("record-of-another-shard", fields(shard=1), "commit record of shard 0 .* is for shard 1", "is for shard 1"),
    Case("unknown-format", fields(format="hsx-commit/9"), "commit record format 'hsx-commit/9'", "hsx-commit/9"),
    Case("not-json", raw_record(b"\xff\xfe{garbage"), "commit record is not JSON", "is not JSON"),
    Case("top-level-array", raw_record(b"[1, 2, 3]"), "must be a JSON object, got a JSON array", "must be a JSON object"),
    Case("missing-checksum", fields(checksum=...), "no field 'checksum'", "no field 'checksum'"),
    Case("key-escapes-the-run", fields(key="../../../etc/passwd"), "names key '../../../etc/passwd'", "not this run's"),
    Case("key-of-another-run", lambda r: fields(key=r.commit()["key"].replace(f"{RUN}/", "run-2/"))(r),
         "names key 'run-2/shards/", "names key 'run-2/shards/.*not this run's"),
    Case("checksum-not-the-keys", fields(checksum="0123456789abcdef"), "names key", "not this run's"),
    Case("size-2-36", fields(bytesStored=1 << 36), r"object size \d+, commit record says 68719476736",
         r"object is \d+ bytes, commit record says 68719476736"),
    # ---- shard objects -----------------------------------------------------------------------------
    Case("header-length-2-63", patch_object(0, struct.pack("<Q", 1 << 63)), "exceeds 100000000", "exceeds 100000000"),
    Case("header-length-past-object", patch_object(0, struct.pack("<Q", 50_000_000)), "header truncated", "header truncated"),
    Case("payload-byte-flipped", patch_object(-9, b"\x5a"), "checksum mismatch", "checksum mismatch"),
    Case("forged-header-not-json", forge(raw_header=b"{not json"), "shard header is not JSON", "shard header is not JSON"),
    Case("forged-header-deep", forge(raw_header=b"[" * DEEP + b"]" * DEEP), "shard header is nested too deeply", "nested too deeply"),
    Case("forged-index-deep", forge(_deep_doc), r"shard index \(__metadata__.hsx\) is nested too deeply", "nested too deeply"),
    Case("forged-offset-infinity", forge(_doc_text('"offset": 0', '"offset": Infinity')), "Infinity is not a JSON number", "Infinity"),
    Case("forged-offset-float", forge(_doc_text('"offset": 0', '"offset": 0.0')), "sample offset must be an integer", "sample offset"),
    Case("forged-sample-xxh3-zz", forge(last_sample(lambda s: s.update(xxh3="zz"))), "sample xxh3 must be 16", "sample xxh3"),
    Case("forged-unknown-codec", forge(tensor("hidden_states", _set(3, "lz4"))), "unknown dtype/codec", "unknown dtype/codec"),
    Case("forged-seqlen", forge(last_sample(lambda s: s.update(seqLen=s["seqLen"] + 1))), "do not fit seqLen", "do not fit seqLen"),
    Case("forged-compressed-shape-2-40", forge(_compressed_huge), "cannot be bf16-split-zstd in", "cannot be bf16-split-zstd"),
    Case("forged-input-ids-as-u8", forge(tensor("input_ids", _set(1, "U8"))), "input_ids", "input_ids"),
    Case("forged-duplicate-sample", forge(_duplicate_index), "out of order or duplicated", "out of order or duplicated"),
    Case("forged-five-tensors", forge(last_sample(_fifth_tensor)), "a sample has 4 tensors, got 5", "4 tensors, got 5"),
    Case("forged-header-of-shard-1", forge(lambda d: d.update(shard=1)), "header is for shard 1", "header is for shard 1"),
    Case("forged-sample-2-37-bytes", forge(last_sample(_enormous_but_consistent)),
         r"samples do not tile the object \(\d+ != \d+ bytes\)", "samples do not tile the object"),
    Case("forged-sample-2-37-bytes-record-agrees", forge(last_sample(_enormous_but_consistent), bytes_stored=_claimed_size),
         r"object size \d+, commit record says \d{12}", r"object is \d+ bytes, commit record says \d{12}"),
]


def _read_all(uri: str) -> str | None:
    """The reader's error on reading every sample (None: all read)."""
    try:
        reader = OutputReader(uri, require_manifest=False)
        for position in range(len(reader)):
            reader.read(position)
    except (ShardFormatError, StoreError) as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    _make_run(root)
    report = run_verify(str(root / RUN))
    assert report.ok and report.samples_checked == 6, report.summary_text()
    assert _read_all(str(root / RUN)) is None
    return root


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 20 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_output(case: Case, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    shutil.copytree(pristine, tmp_path / "out")
    run = Run(tmp_path / "out")
    case.mutate(run)
    tracemalloc.start()
    started = time.monotonic()
    try:
        report = run_verify(run.uri)
        code = main(["verify", run.uri, "--json"])
        reader_error = _read_all(run.uri)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.monotonic() - started
    assert not report.ok
    assert any(re.search(case.verify, e) for e in report.errors), report.errors
    assert code == EXIT_PERMANENT
    assert json.loads(capsys.readouterr().out)["ok"] is False
    assert reader_error is not None and re.search(case.reader, reader_error), reader_error
    assert peak < MEMORY_BOUND and elapsed < TIME_BOUND, (peak, elapsed)


ON_S3 = ["checksum-zz", "deep-record", "infinity", "stop-1e9-int", "key-escapes-the-run", "forged-header-deep",
         "forged-sample-2-37-bytes-record-agrees"]


@pytest.mark.s3
@pytest.mark.parametrize("case", [c for c in CASES if c.name in ON_S3], ids=ON_S3)
def test_hostile_output_on_s3(case: Case, pristine: Path, tmp_path: Path, s3_env: Any, s3_bucket: str) -> None:
    """The same outcomes when the damaged run is in a real S3 bucket (ranged reads, HEAD for sizes)."""
    import shutil

    shutil.copytree(pristine, tmp_path / "out")
    run = Run(tmp_path / "out")
    case.mutate(run)
    client = s3_env.client()
    for path in sorted(run.root.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            client.put_object(Bucket=s3_bucket, Key=path.relative_to(run.root).as_posix(), Body=path.read_bytes())
    spec = OutputSpec.model_validate({"uri": f"s3://{s3_bucket}", "endpoint": s3_env.endpoint, "pathStyle": True})
    uri = f"s3://{s3_bucket}/{RUN}"  # keys in records are relative to the store root
    tracemalloc.start()
    try:
        report = run_verify(uri, output=spec)
        try:
            reader = OutputReader(uri, output=spec, require_manifest=False)
            for position in range(len(reader)):
                reader.read(position)
            reader_error = None
        except (ShardFormatError, StoreError) as exc:
            reader_error = str(exc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not report.ok and any(re.search(case.verify, e) for e in report.errors), report.errors
    assert reader_error is not None and re.search(case.reader, reader_error), reader_error
    assert peak < MEMORY_BOUND, peak


def test_a_local_ranged_read_past_the_end_allocates_what_exists(tmp_path: Path) -> None:
    """A damaged index asking for 2**36 bytes of a small file: read() would first allocate them."""
    from hsx_extractor.storage.backends import LocalBackend

    (tmp_path / "k").write_bytes(b"0123456789")
    backend = LocalBackend(tmp_path)
    tracemalloc.start()
    try:
        got = backend.get_range("k", 4, 1 << 36)
        assert backend.get_range("k", 20, 1 << 36) == b""
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == b"456789" and peak < 1 << 20
    into = memoryview(bytearray(16))
    assert bytes(backend.get_range_into("k", 4, into)) == b"456789"  # what exists
    assert bytes(backend.get_range_into("k", 20, into)) == b""


def test_an_oversized_stored_json_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A manifest past MAX_NAMED_JSON_BYTES (a sparse 256 MiB file here) is refused from its size:
    the bytes are never read into memory."""
    from hsx_extractor.storage import store as store_module
    from hsx_extractor.storage.backends import PermanentStoreError

    spec = OutputSpec.model_validate({"uri": str(tmp_path / "out")})
    store = open_store(spec, RUN)
    manifest = tmp_path / "out" / RUN / "manifest.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    with open(manifest, "wb") as f:
        f.truncate(store_module.MAX_NAMED_JSON_BYTES + 1)
    tracemalloc.start()
    try:
        limit = store_module.MAX_NAMED_JSON_BYTES
        with pytest.raises(PermanentStoreError, match=rf"manifest.json is {limit + 1} bytes, more than the {limit} "):
            store.get_json("manifest.json")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.s3
def test_an_oversized_commit_record_on_s3_is_refused_from_its_length(
    tmp_path: Path, s3_env: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3's GetObject gives the length first: a record past the bound is refused and its body never read."""
    from hsx_extractor.storage import store as store_module
    from hsx_extractor.storage.backends import PermanentStoreError

    monkeypatch.setattr(store_module, "MAX_COMMIT_BYTES", 4096)
    spec = OutputSpec.model_validate({"uri": f"s3://{s3_bucket}", "endpoint": s3_env.endpoint, "pathStyle": True})
    store = open_store(spec, RUN)
    s3_env.client().put_object(Bucket=s3_bucket, Key=store.layout.commit_key(0), Body=b" " * 5000)
    with pytest.raises(PermanentStoreError, match=r"is damaged: object .*shard-000000.* is 5000 bytes, more than the 4096"):
        store.get_commit(0)


def test_a_reader_keeps_only_what_reading_checks(tmp_path: Path) -> None:
    """Each DataLoader worker gets a pickled copy of the reader: per shard it must carry the sample
    list and the object's facts, not the commit record's token counts and quarantine (nor the
    manifest's copies of them), which made ~0.57 MB a shard before."""
    import pickle

    from tests.storage.samples import CAPTURE, plan_for, write_run

    def pickled(shards: int) -> tuple[int, int]:
        store = open_store(OutputSpec.model_validate({"uri": str(tmp_path / f"out{shards}")}), "r", writing=True)
        plan = plan_for(4 * shards, 4)
        commits = write_run(store, plan, quarantine=frozenset({1}))
        store.finalize([(s["index"], s["start"], s["stop"]) for s in plan["shards"]], {"capture": CAPTURE})
        reader = OutputReader(str(tmp_path / f"out{shards}" / "r"))
        assert len(reader) == 4 * shards - 1 and reader.read(len(reader) - 1).index == 4 * shards - 1
        return len(pickle.dumps(reader)), len(pickle.dumps(commits))

    (reader_10, commits_10), (reader_40, commits_40) = pickled(10), pickled(40)
    per_shard, per_record = (reader_40 - reader_10) / 30, (commits_40 - commits_10) / 30
    print(f"pickled bytes per shard: reader {per_shard:.0f}, commit records {per_record:.0f}")
    assert per_shard < 300, per_shard  # indices, key, checksum, sizes
    assert per_record > 3 * per_shard  # what a copy of the records (their counts) would have cost
