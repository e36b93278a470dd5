"""The shard format: exact round trip, one read per sample, damage detection, safetensors view."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hsx_extractor.storage.shard_format import (
    SampleRecord,
    ShardFormatError,
    decode_sample,
    encode_sample,
    layout_shard,
    parse_header,
)
from tests.storage.samples import assert_same, record


def _shard_bytes(records: list[SampleRecord], codec: str) -> tuple[bytes, list]:
    encoded = {r.index: encode_sample(r, codec) for r in records}
    header, placed = layout_shard(3, (e.entry for e in encoded.values()))
    return header + b"".join(encoded[e.index].payload for e in placed), list(placed)


@st.composite
def samples(draw: st.DrawFn) -> SampleRecord:
    seq_len = draw(st.integers(1, 24))
    hidden = draw(st.integers(1, 24))
    num_aux = draw(st.integers(1, 3))
    u16 = hnp.arrays(np.uint16, (seq_len, hidden))
    return SampleRecord(
        index=draw(st.integers(0, 10**9)),
        sample_id=draw(st.text(max_size=12)),
        input_ids=draw(hnp.arrays(np.int32, seq_len)),
        loss_mask=draw(hnp.arrays(np.uint8, seq_len, elements=st.integers(0, 1))),
        aux_hidden_states=draw(hnp.arrays(np.uint16, (seq_len, num_aux * hidden))),
        hidden_states=draw(u16),
    )


@settings(max_examples=120, deadline=None)
@given(rec=samples(), codec=st.sampled_from(["raw", "bf16-split-zstd"]))
def test_every_tensor_round_trips_byte_exact(rec: SampleRecord, codec: str) -> None:
    enc = encode_sample(rec, codec)
    assert enc.entry.length == len(enc.payload) and enc.entry.length % 8 == 0
    assert_same(decode_sample(enc.payload, enc.entry), rec)


@pytest.mark.parametrize("codec", ["raw", "bf16-split-zstd"])
def test_each_sample_is_one_contiguous_range_of_the_shard(codec: str) -> None:
    records = [record(i, 3 + 11 * i, hidden=32) for i in (4, 0, 2, 9)]
    blob, placed = _shard_bytes(records, codec)
    header = parse_header(blob)
    assert [s.index for s in header.samples] == [0, 2, 4, 9]
    assert header.object_size == len(blob)
    by_index = {r.index: r for r in records}
    for entry in header.samples:
        start = header.data_start + entry.offset
        assert_same(decode_sample(blob[start : start + entry.length], entry), by_index[entry.index])
    if codec == "bf16-split-zstd":
        assert header.data_length < sum(e.raw_bytes for e in placed)


def test_damage_is_detected() -> None:
    blob, _ = _shard_bytes([record(0, 17), record(1, 9)], "bf16-split-zstd")
    header = parse_header(blob)
    entry = header.samples[1]
    start = header.data_start + entry.offset
    damaged = bytearray(blob[start : start + entry.length])
    damaged[len(damaged) // 2] ^= 0x01
    with pytest.raises(ShardFormatError, match="checksum"):
        decode_sample(bytes(damaged), entry)
    with pytest.raises(ShardFormatError):
        decode_sample(blob[start : start + entry.length - 8], entry)
    with pytest.raises(ShardFormatError, match="truncated"):
        parse_header(blob[: header.data_start - 1])
    with pytest.raises(ShardFormatError):
        parse_header(b"\xff" * 16)
    with pytest.raises(ShardFormatError):
        parse_header(blob[:8] + b"[" + blob[9:])


def test_bad_samples_are_refused_with_a_clear_error() -> None:
    good = record(0, 5, hidden=8)
    with pytest.raises(ValueError, match="aux_hidden_states"):
        SampleRecord(
            0, "x", good.input_ids, good.loss_mask, good.aux_hidden_states[:, :7], good.hidden_states
        )
    with pytest.raises(ValueError, match="int32"):
        SampleRecord(
            0,
            "x",
            good.input_ids.astype(np.int64),
            good.loss_mask,
            good.aux_hidden_states,
            good.hidden_states,
        )
    with pytest.raises(ValueError, match="loss_mask"):
        SampleRecord(0, "x", good.input_ids, good.loss_mask[:4], good.aux_hidden_states, good.hidden_states)


def test_uncompressed_shard_is_a_safetensors_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    records = [record(i, 7 + i, hidden=16) for i in range(3)]  # odd lengths: padding needed
    blob, _ = _shard_bytes(records, "raw")
    path = tmp_path / "shard.safetensors"
    path.write_bytes(blob)
    tensors = safetensors.torch.load_file(str(path))
    for r in records:
        assert torch.equal(tensors[f"{r.index}.input_ids"], torch.from_numpy(r.input_ids))
        assert torch.equal(tensors[f"{r.index}.loss_mask"], torch.from_numpy(r.loss_mask))
        aux = tensors[f"{r.index}.aux_hidden_states"]
        assert aux.dtype == torch.bfloat16 and aux.shape == r.aux_hidden_states.shape
        assert aux.view(torch.int16).numpy().view(np.uint16).tobytes() == r.aux_hidden_states.tobytes()
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata()["format"] == "hsx-shard/1"


def test_compressed_shard_opens_in_safetensors_as_opaque_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    records = [record(i, 40, hidden=64) for i in range(2)]
    blob, placed = _shard_bytes(records, "bf16-split-zstd")
    path = tmp_path / "shard.safetensors"
    path.write_bytes(blob)
    tensors = safetensors.torch.load_file(str(path))
    stored = tensors["1.aux_hidden_states.bf16-split-zstd"]
    assert stored.dtype == torch.uint8 and stored.numel() == placed[1].tensor("aux_hidden_states").length


@settings(max_examples=40, deadline=None)
@given(
    recs=st.lists(samples(), min_size=1, max_size=6, unique_by=lambda r: r.index),
    codec=st.sampled_from(["raw", "bf16-split-zstd"]),
)
def test_any_shard_round_trips_through_its_header(recs: list[SampleRecord], codec: str) -> None:
    blob, _ = _shard_bytes(recs, codec)
    header = parse_header(blob)
    assert header.object_size == len(blob)
    by_index = {r.index: r for r in recs}
    assert [s.index for s in header.samples] == sorted(by_index)
    for entry in header.samples:
        start = header.data_start + entry.offset
        assert_same(decode_sample(blob[start : start + entry.length], entry), by_index[entry.index])


def test_an_fp8_shard_round_trips_within_fp8_precision_and_is_checksummed() -> None:
    from hsx_extractor.protocol import bf16_bits_to_f32

    records = [record(i, 5 + 7 * i, hidden=64) for i in range(4)]
    blob, _ = _shard_bytes(records, "fp8-e4m3-rowscale")
    header = parse_header(blob)
    for rec, entry in zip(records, header.samples, strict=True):
        assert {t.codec for t in entry.tensors if t.dtype == "BF16"} == {"fp8-e4m3-rowscale"}
        stored = blob[header.data_start + entry.offset : header.data_start + entry.offset + entry.length]
        back = decode_sample(stored, entry)
        assert np.array_equal(back.input_ids, rec.input_ids) and np.array_equal(back.loss_mask, rec.loss_mask)
        for name in ("aux_hidden_states", "hidden_states"):
            ours, theirs = bf16_bits_to_f32(getattr(back, name)), bf16_bits_to_f32(getattr(rec, name))
            cosine = (ours * theirs).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
            assert cosine.min() > 0.998 and not np.array_equal(ours, theirs)  # lossy, and close
        damaged = bytearray(stored)
        damaged[0] ^= 1
        with pytest.raises(ShardFormatError, match="checksum mismatch"):
            decode_sample(bytes(damaged), entry)
