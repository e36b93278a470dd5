"""Dataset files as users have them: JSONL plain, gzip or zstd, and Parquet as Hugging Face datasets
export it; local and on S3 (the dataset's own endpoint), streamed, with each row's line number."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import Prepared, Rejected, read_samples
from hsx_extractor.run.sources import (
    CHUNK,
    DatasetError,
    OversizedRow,
    SourceRow,
    _RangedFile,
    dataset_kind,
    iter_rows,
    split_lines,
)
from hsx_extractor.run.tokens import ChatTokenizer
from hsx_extractor.storage.s3_client import S3Endpoint
from tests.run.helpers import chat_rows

ROWS = chat_rows(5)
JSONL = b"\n".join([json.dumps(ROWS[0]).encode(), b"", json.dumps(ROWS[1]).encode(), b"{broken", b"  "]) + b"\n"
# (line, index) of what JSONL holds: blank lines are no rows but count as lines.
EXPECTED = [(1, "Prepared"), (3, "Prepared"), (4, "Rejected")]


def outcomes(items: Any) -> list[tuple[int | None, str]]:
    return [(i.line, type(i).__name__) for i in items]


def test_kinds_come_from_the_suffix() -> None:
    assert [dataset_kind(u) for u in ("d.jsonl", "s3://b/d.jsonl.gz", "d.JSONL.ZST", "x/d.parquet", "d.json")] == [
        "jsonl", "gzip", "zstd", "parquet", "jsonl"
    ]


@pytest.mark.parametrize(
    ("name", "pack"),
    [
        ("d.jsonl", lambda b: b),
        ("d.jsonl.gz", gzip.compress),
        ("d.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
        # Two concatenated zstd frames, as pzstd and chunked writers produce.
        ("d2.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b[:40]) + zstandard.ZstdCompressor().compress(b[40:])),
    ],
)
def test_jsonl_plain_and_compressed_read_the_same(
    name: str, pack: Any, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    path = tmp_path / name
    path.write_bytes(pack(JSONL))
    rows = list(iter_rows(str(path)))
    assert [r.line for r in rows] == [1, 3, 4]
    assert outcomes(read_samples(rows, tokenizer, 512)) == EXPECTED


def test_damaged_compression_is_a_dataset_error(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(JSONL)[:-12] + b"garbage!garbage!")
    with pytest.raises(DatasetError, match="cannot decompress"):
        list(iter_rows(str(path)))


def test_lines_are_split_across_chunk_boundaries() -> None:
    data = b"a" * (CHUNK - 1) + b"\nbb\n" + b"c" * (CHUNK + 5)
    chunks = iter([data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] + [b""])
    got = list(split_lines(lambda _: next(chunks)))
    assert got == [b"a" * (CHUNK - 1) + b"\n", b"bb\n", b"c" * (CHUNK + 5)]


def parquet_file(path: Path) -> Path:
    """Rows as `datasets` exports chats: messages as a list of structs (absent fields null), plus a
    pre-tokenized row in the same file, a ShareGPT row and a row with a lone role problem."""
    table = pa.Table.from_pylist(
        [
            {"id": "p0", "messages": ROWS[0]["messages"], "input_ids": None, "loss_mask": None, "conversations": None},
            {"id": "p1", "messages": None, "input_ids": [1, 40, 41], "loss_mask": [0, 1, 1], "conversations": None},
            {
                "id": "p2",
                "messages": None,
                "input_ids": None,
                "loss_mask": None,
                "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}],
            },
            {"id": "p3", "messages": [{"role": "wizard", "content": "x"}], "input_ids": None, "loss_mask": None, "conversations": None},
            {"id": "p4", "messages": ROWS[1]["messages"], "input_ids": [1, 2], "loss_mask": [0, 1], "conversations": None},
        ]
    )
    pq.write_table(table, path, row_group_size=2)
    return path


def test_parquet_rows_are_rows(tmp_path: Path, tokenizer: ChatTokenizer) -> None:
    path = parquet_file(tmp_path / "d.parquet")
    items = list(read_samples(iter_rows(str(path)), tokenizer, 512))
    assert outcomes(items) == [(1, "Prepared"), (2, "Prepared"), (3, "Prepared"), (4, "Rejected"), (5, "Rejected")]
    assert [i.reason for i in items if isinstance(i, Rejected)] == [Reason.UNKNOWN_ROLE, Reason.AMBIGUOUS_ROW]
    assert [i.sample_id for i in items] == ["p0", "p1", "p2", "p3", "p4"]


def test_parquet_through_ranged_reads_matches_the_local_file(tmp_path: Path) -> None:
    path = parquet_file(tmp_path / "d.parquet")
    ranged = _RangedFile(str(path), None)
    table = pq.ParquetFile(ranged).read()
    assert table.to_pylist() == pq.read_table(path).to_pylist()


def test_not_parquet_is_a_dataset_error(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(JSONL)
    with pytest.raises(DatasetError, match="Parquet"):
        list(iter_rows(str(path)))


@pytest.mark.s3
def test_every_format_from_s3_with_the_datasets_own_endpoint(
    tmp_path: Path, s3_server: Any, s3_bucket: str, tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    where = S3Endpoint(s3_server.endpoint, s3_server.region, True, (s3_server.access_key, s3_server.secret_key, None))
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="sets/d.jsonl.gz", Body=gzip.compress(JSONL))
    client.put_object(Bucket=s3_bucket, Key="sets/d.jsonl.zst", Body=zstandard.ZstdCompressor().compress(JSONL))
    client.put_object(Bucket=s3_bucket, Key="sets/d.parquet", Body=parquet_file(tmp_path / "d.parquet").read_bytes())
    for key in ("sets/d.jsonl.gz", "sets/d.jsonl.zst"):
        rows: list[SourceRow] = list(iter_rows(f"s3://{s3_bucket}/{key}", where))
        assert outcomes(read_samples(rows, tokenizer, 512)) == EXPECTED
    parquet = list(read_samples(iter_rows(f"s3://{s3_bucket}/sets/d.parquet", where), tokenizer, 512))
    assert [type(i).__name__ for i in parquet] == ["Prepared", "Prepared", "Prepared", "Rejected", "Rejected"]
    assert all(isinstance(i, Prepared) for i in parquet[:3])


def test_a_line_past_the_cap_is_read_past_with_its_size_and_digest() -> None:
    # Issue 32, item 2: the cap applied only after the whole line was in memory.
    from hsx_extractor.run.plan import row_digest
    from hsx_extractor.run.sources import OversizedRow

    long_line = b'{"id": "big", "x": "' + b"y" * (3 * CHUNK) + b'"}'
    data = b'{"id": 1}\n' + long_line + b"\r\n" + b'{"id": 2}\n' + long_line
    chunks = iter([data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] + [b""])
    held: list[int] = []

    def read(_: int) -> bytes:
        return next(chunks)

    got = []
    for item in split_lines(read, max_line=1 << 20):
        held.append(len(item) if isinstance(item, bytes) else 0)
        got.append(item)
    assert got[0] == b'{"id": 1}\n' and got[2] == b'{"id": 2}\n'
    for oversized in (got[1], got[3]):
        assert isinstance(oversized, OversizedRow)
        assert oversized.size >= len(long_line)
        # The same digest the line would have had whole (what the plan and resume compare).
        assert oversized.digest == row_digest(long_line)
    assert max(held) < 1 << 20


def test_an_oversized_line_is_quarantined_too_long_with_its_line_number(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "d.jsonl"
    big = json.dumps({**ROWS[1], "id": "big", "pad": "z" * (2 << 20)}).encode()
    path.write_bytes(b"\n".join([json.dumps(ROWS[0]).encode(), big, json.dumps(ROWS[2]).encode()]) + b"\n")
    got = list(read_samples(iter_rows(str(path), max_line=1 << 20), tokenizer, 16))
    assert outcomes(got)[1] == (2, "Rejected")
    assert got[1].reason == Reason.TOO_LONG and "not parsed" in got[1].detail, got[1]


def test_a_parquet_row_with_a_huge_cell_never_reaches_the_tokenizer(tmp_path: Path, tokenizer) -> None:
    # An 8 MiB cell reached the tokenizer with maxLength 16 (Parquet skipped the pre-parse cap).
    path = tmp_path / "d.parquet"
    huge = [{"role": "user", "content": "q" * (8 << 20)}, {"role": "assistant", "content": "a"}]
    pq.write_table(pa.Table.from_pylist([{"id": "ok", "messages": ROWS[0]["messages"]},
                                         {"id": "huge", "messages": huge}]), path)  # fmt: skip

    class Watching:
        def __init__(self, real: Any) -> None:
            self.real, self.vocab_size, self.bos_id = real, real.vocab_size, real.bos_id
            self.longest = 0

        def chat_samples(self, messages: Any, tools: Any, expand: bool) -> Any:
            self.longest = max(self.longest, *(len(m.get("content") or "") for m in messages))
            return self.real.chat_samples(messages, tools, expand)

    watching = Watching(tokenizer)
    got = list(read_samples(iter_rows(str(path)), watching, 16))
    assert isinstance(got[1], Rejected) and got[1].reason == Reason.TOO_LONG, got[1]
    assert "at least" in got[1].detail and watching.longest < 1 << 20


def test_a_parquet_row_past_the_cap_is_never_decoded_to_python(tmp_path: Path, tokenizer) -> None:
    """With the reader's cap (row_bytes_limit), a row whose Arrow data is past it comes as its size only:
    a 2M-id list would be ~9x its bytes as Python ints (issue 32, item 2). Rows around it are decoded."""
    path = tmp_path / "d.parquet"
    ids = list(range(2_000_000))
    pq.write_table(pa.Table.from_pylist([
        {"id": "a", "input_ids": [1, 40, 41], "loss_mask": [0, 1, 1]},
        {"id": "huge", "input_ids": ids, "loss_mask": [1] * len(ids)},
        {"id": "c", "input_ids": [1, 42], "loss_mask": [0, 1]},
    ]), path)  # fmt: skip
    rows = list(iter_rows(str(path), max_line=1 << 20))
    assert isinstance(rows[0].data, dict) and isinstance(rows[2].data, dict)
    assert isinstance(rows[1].data, OversizedRow) and rows[1].data.size > 16 << 20 and rows[1].line == 2
    again = list(iter_rows(str(path), max_line=1 << 20))[1].data
    assert again == rows[1].data  # the same digest each read: resume and the plan agree
    got = list(read_samples(rows, tokenizer, 16))
    assert [type(g).__name__ for g in got] == ["Prepared", "Rejected", "Prepared"], got
    assert got[1].reason == Reason.TOO_LONG and got[1].line == 2
