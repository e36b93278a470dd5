"""The shard format (docs/format.md): whole samples, one ranged read each, checksummed.

A shard is a safetensors-framed object: an 8-byte little-endian header length, a JSON header,
then the data section. Each sample's stored tensors are contiguous in the data section, padded
to 8 bytes, so one ranged read of ``[data_start + offset, + length)`` fetches a whole sample.
The header's ``__metadata__["hsx"]`` holds the hsx index (see :class:`SampleEntry`); the
per-tensor safetensors entries describe the *stored* bytes, so an uncompressed shard is a
valid safetensors file. Pure functions; no I/O.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import xxhash

from hsx_extractor.storage import fp8
from hsx_extractor.storage.compress import (
    CODEC_FP8,
    CODEC_RAW,
    CODECS,
    CodecError,
    PlaneBuffers,
    decode_bf16_array,
    encode_bf16_parts,
)
from hsx_extractor.storage.layout import MAX_SHARDS
from hsx_extractor.storage.native import Bf16Kernels
from hsx_extractor.storage.stored_json import (
    MAX_INDEX,
    ShardFormatError,
    json_dict,
    json_hex16,
    json_int,
    json_list,
    json_str,
    load_json,
    show,
)

FORMAT_VERSION: Final = "hsx-shard/1"
# Every hidden state is stored as bf16, whatever the model computes in (the manifest's capture.dtype).
STATES_DTYPE: Final = "bfloat16"
# Output compression setting (OutputSpec.compression) -> codec for the hidden-state tensors.
COMPRESSION_CODECS: Final = {"none": "raw", "bf16-zstd": "bf16-split-zstd", "fp8-e4m3": "fp8-e4m3-rowscale"}

INPUT_IDS: Final = "input_ids"
LOSS_MASK: Final = "loss_mask"
AUX: Final = "aux_hidden_states"
FINAL: Final = "hidden_states"
TENSOR_ORDER: Final = (INPUT_IDS, LOSS_MASK, AUX, FINAL)
PAD: Final = "pad"
ALIGN: Final = 8
MAX_HEADER_BYTES: Final = 100_000_000  # safetensors' own limit
_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "I32": np.dtype("<i4"),
    "U8": np.dtype("u1"),
    "BF16": np.dtype("<u2"),
}


def checksum(data: bytes | memoryview) -> str:
    """xxh3-64 of ``data`` as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class SampleRecord:
    """One extracted sample. bf16 tensors are uint16 arrays of their bits."""

    index: int  # position in the dataset (the sample's identity in the run)
    sample_id: str  # the dataset row's id
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L], 1 = assistant token
    aux_hidden_states: np.ndarray  # uint16 (bf16 bits) [L, K*H]
    hidden_states: np.ndarray  # uint16 (bf16 bits) [L, H]

    def __post_init__(self) -> None:
        check_sample(self)

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> dict[str, np.ndarray]:
        return {
            INPUT_IDS: self.input_ids,
            LOSS_MASK: self.loss_mask,
            AUX: self.aux_hidden_states,
            FINAL: self.hidden_states,
        }


def check_sample(rec: SampleRecord) -> None:
    """Raise ValueError unless dtypes and shapes agree with the format."""
    expected = {INPUT_IDS: np.int32, LOSS_MASK: np.uint8, AUX: np.uint16, FINAL: np.uint16}
    for name, array in rec.tensors().items():
        if not isinstance(array, np.ndarray) or array.dtype != expected[name]:
            got = getattr(array, "dtype", type(array).__name__)
            raise ValueError(f"sample {rec.index}: {name} must be {np.dtype(expected[name])}, got {got}")
    seq_len = rec.input_ids.shape[0] if rec.input_ids.ndim == 1 else -1
    if seq_len < 1 or rec.loss_mask.shape != (seq_len,):
        raise ValueError(f"sample {rec.index}: input_ids and loss_mask must both be [L] with L >= 1")
    if rec.hidden_states.ndim != 2 or rec.hidden_states.shape[0] != seq_len or rec.hidden_states.shape[1] < 1:
        raise ValueError(f"sample {rec.index}: hidden_states must be [L, H], got {rec.hidden_states.shape}")
    hidden = rec.hidden_states.shape[1]
    aux = rec.aux_hidden_states
    if aux.ndim != 2 or aux.shape[0] != seq_len or aux.shape[1] < hidden or aux.shape[1] % hidden:
        raise ValueError(
            f"sample {rec.index}: aux_hidden_states must be [L, K*H] with H={hidden}, got {aux.shape}"
        )
    if rec.index < 0 or not isinstance(rec.sample_id, str):
        raise ValueError(f"sample {rec.index}: index must be >= 0 and sample_id a string")


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor of a sample."""

    name: str  # input_ids | loss_mask | aux_hidden_states | hidden_states
    dtype: str  # logical dtype: I32 | U8 | BF16
    shape: tuple[int, ...]  # logical shape
    codec: str  # raw | bf16-split-zstd
    offset: int  # start of the stored bytes, relative to the sample's start
    length: int  # stored bytes

    @property
    def num_values(self) -> int:
        return math.prod(self.shape)  # Python ints: a hostile shape cannot wrap around

    @property
    def raw_length(self) -> int:
        return self.num_values * _DTYPES[self.dtype].itemsize

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.codec, self.offset, self.length]

    @classmethod
    def from_json(cls, obj: Sequence[Any]) -> TensorEntry:
        if not isinstance(obj, list) or len(obj) != 6:
            raise ShardFormatError(f"a tensor entry must be [name, dtype, shape, codec, offset, length], got {show(obj)}")
        name, dtype, shape, codec, offset, length = obj
        dims = json_list(shape, "tensor shape")
        if not 1 <= len(dims) <= 2:
            raise ShardFormatError(f"tensor {show(name)}: shape must have 1 or 2 dimensions, got {len(dims)}")
        return cls(
            json_str(name, "tensor name"),
            json_str(dtype, "tensor dtype"),
            tuple(json_int(d, "tensor dimension") for d in dims),
            json_str(codec, "tensor codec"),
            json_int(offset, "tensor offset"),
            json_int(length, "tensor length"),
        )


@dataclass(frozen=True)
class SampleEntry:
    """The index row of one sample: everything needed for one ranged read and its check."""

    index: int  # dataset position
    sample_id: str
    offset: int  # start of the sample's bytes, relative to the data section
    length: int  # stored bytes including padding
    seq_len: int
    checksum: str  # xxh3-64 hex of the sample's stored bytes (padding included)
    tensors: tuple[TensorEntry, ...]

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise ShardFormatError(f"sample {self.index} has no tensor {name!r}")

    @property
    def raw_bytes(self) -> int:
        return sum(t.raw_length for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "sampleId": self.sample_id,
            "offset": self.offset,
            "length": self.length,
            "seqLen": self.seq_len,
            "xxh3": self.checksum,
            "tensors": [t.to_json() for t in self.tensors],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SampleEntry:
        obj = json_dict(obj, "sample entry")
        tensors = json_list(obj["tensors"], "sample tensors")
        if len(tensors) != len(TENSOR_ORDER):
            raise ShardFormatError(f"a sample has {len(TENSOR_ORDER)} tensors, got {len(tensors)}")
        return cls(
            index=json_int(obj["index"], "sample index", hi=MAX_INDEX),
            sample_id=json_str(obj["sampleId"], "sampleId"),
            offset=json_int(obj["offset"], "sample offset"),
            length=json_int(obj["length"], "sample length"),
            seq_len=json_int(obj["seqLen"], "seqLen", lo=1),
            checksum=json_hex16(obj["xxh3"], "sample xxh3"),
            tensors=tuple(TensorEntry.from_json(t) for t in tensors),
        )


class NonFiniteValues(ValueError):
    """A sample's hidden states hold Inf or NaN values: a shard does not store it
    (ShardBuilder.add refuses it, adding nothing)."""

    def __init__(self, index: int, count: int) -> None:
        super().__init__(f"{count} Inf/NaN values")
        self.index, self.count = index, count


@dataclass(frozen=True)
class EncodedSample:
    """A sample's stored bytes and its index row (offset still 0: set when the shard is laid out)."""

    entry: SampleEntry
    parts: tuple[bytes | memoryview, ...]  # the stored bytes, in order, not yet concatenated
    non_finite: int = 0  # Inf/NaN values among its hidden states (a shard stores none: ShardBuilder.add)

    @property
    def payload(self) -> bytes:
        return b"".join(self.parts)


_LOGICAL_DTYPE = {INPUT_IDS: "I32", LOSS_MASK: "U8", AUX: "BF16", FINAL: "BF16"}


def encode_sample(rec: SampleRecord, codec: str, planes: PlaneBuffers | None = None) -> EncodedSample:
    """Stored bytes of one sample; hidden states with ``codec``, ids and mask raw, and how many of its
    hidden-state values are Inf or NaN. With ``planes``, parts may live in its buffers: write them out
    before the buffers are reused."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    parts: list[bytes | memoryview] = []
    tensors: list[TensorEntry] = []
    offset = non_finite = 0
    for name, array in rec.tensors().items():
        if _LOGICAL_DTYPE[name] == "BF16":
            used, stored, bad = encode_bf16_parts(array, codec, planes)
            non_finite += bad
        else:
            raw = np.ascontiguousarray(array, dtype=_DTYPES[_LOGICAL_DTYPE[name]])
            used, stored = CODEC_RAW, [raw.data.cast("B")]
        length = sum(memoryview(p).nbytes for p in stored)
        tensors.append(TensorEntry(name, _LOGICAL_DTYPE[name], tuple(array.shape), used, offset, length))
        parts += stored
        offset += length
    parts.append(b"\0" * (-offset % ALIGN))
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    length = offset + len(parts[-1])
    entry = SampleEntry(rec.index, rec.sample_id, 0, length, rec.seq_len, digest.hexdigest(), tuple(tensors))
    return EncodedSample(entry, tuple(parts), non_finite)


# Gives the buffer a decoded hidden-state tensor is written into: (tensor name, number of bf16 values) ->
# a flat uint16 array of that many values.
Allocate = Callable[[str, int], np.ndarray]


def decode_sample(
    stored: bytes | memoryview,
    entry: SampleEntry,
    verify: bool = True,
    allocate: Allocate | None = None,
    kernels: Bf16Kernels | None = None,
) -> SampleRecord:
    """The sample an entry describes, from its ``entry.length`` stored bytes; its hidden states decoded
    into buffers from ``allocate`` when given, with the native ``kernels`` when given (storage/native.py)."""
    view = memoryview(stored)
    if len(view) != entry.length:
        raise ShardFormatError(f"sample {entry.index}: got {len(view)} bytes, index says {entry.length}")
    if verify and checksum(view) != entry.checksum:
        raise ShardFormatError(f"sample {entry.index} ({entry.sample_id}): checksum mismatch")
    arrays: dict[str, np.ndarray] = {}
    for t in entry.tensors:
        chunk = view[t.offset : t.offset + t.length]
        try:
            if t.dtype == "BF16":
                out = allocate(t.name, t.num_values) if allocate is not None else None
                rows = t.shape[0] if len(t.shape) == 2 else 1
                flat = decode_bf16_array(t.codec, chunk, t.num_values, rows, out, kernels)
            elif t.codec == CODEC_RAW and len(chunk) == t.raw_length:
                flat = np.frombuffer(chunk, dtype=_DTYPES[t.dtype]).copy()
            else:
                raise CodecError(f"{t.dtype} tensor stored as {t.codec} with {len(chunk)} bytes")
        except CodecError as exc:
            raise ShardFormatError(f"sample {entry.index}: tensor {t.name}: {exc}") from exc
        arrays[t.name] = flat.reshape(t.shape)
    try:
        return SampleRecord(
            entry.index,
            entry.sample_id,
            arrays[INPUT_IDS].astype(np.int32, copy=False),
            arrays[LOSS_MASK],
            arrays[AUX].astype(np.uint16, copy=False),
            arrays[FINAL].astype(np.uint16, copy=False),
        )
    except (KeyError, ValueError) as exc:
        raise ShardFormatError(f"sample {entry.index}: {exc}") from exc


@dataclass(frozen=True)
class ShardHeader:
    """A parsed shard header."""

    shard_index: int
    data_start: int  # byte offset of the data section in the object (8 + JSON length)
    samples: tuple[SampleEntry, ...]  # sorted by dataset index
    header_checksum: str  # xxh3-64 of the first data_start bytes: the shard checksum

    @property
    def data_length(self) -> int:
        return sum(s.length for s in self.samples)

    @property
    def object_size(self) -> int:
        return self.data_start + self.data_length


def _safetensors_entries(entry: SampleEntry, base: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    end = 0
    for t in entry.tensors:
        start = base + t.offset
        if t.codec == CODEC_RAW:
            out[f"{entry.index}.{t.name}"] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [start, start + t.length],
            }
        else:
            # Compressed bytes are not a tensor; exposing them as opaque U8 keeps the file valid safetensors.
            out[f"{entry.index}.{t.name}.{t.codec}"] = {
                "dtype": "U8",
                "shape": [t.length],
                "data_offsets": [start, start + t.length],
            }
        end = t.offset + t.length
    if end < entry.length:
        out[f"{entry.index}.{PAD}"] = {
            "dtype": "U8",
            "shape": [entry.length - end],
            "data_offsets": [base + end, base + entry.length],
        }
    return out


def layout_shard(shard_index: int, encoded: Iterable[SampleEntry]) -> tuple[bytes, tuple[SampleEntry, ...]]:
    """Sort samples by dataset index, assign offsets, and build the header bytes.

    Returns (header bytes, entries with their offsets). The object is the header followed by
    each sample's payload in the returned order.
    """
    ordered = sorted(encoded, key=lambda e: e.index)
    placed: list[SampleEntry] = []
    offset = 0
    for e in ordered:
        placed.append(SampleEntry(e.index, e.sample_id, offset, e.length, e.seq_len, e.checksum, e.tensors))
        offset += e.length
    index_doc = {"format": FORMAT_VERSION, "shard": shard_index, "samples": [e.to_json() for e in placed]}
    header: dict[str, Any] = {
        "__metadata__": {"format": FORMAT_VERSION, "hsx": json.dumps(index_doc, separators=(",", ":"))}
    }
    for e in placed:
        header.update(_safetensors_entries(e, e.offset))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    if len(raw) > MAX_HEADER_BYTES:
        raise ShardFormatError(
            f"shard {shard_index}: header of {len(raw)} bytes is too large; use larger samples per shard"
        )
    return struct.pack("<Q", len(raw)) + raw, tuple(placed)


def header_length(first8: bytes) -> int:
    """Total header bytes (8 + JSON) from the object's first 8 bytes."""
    if len(first8) < 8:
        raise ShardFormatError("shard is shorter than 8 bytes")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER_BYTES:
        raise ShardFormatError(f"shard header length {n} exceeds {MAX_HEADER_BYTES}")
    return 8 + n


def parse_header(head: bytes) -> ShardHeader:
    """Parse and check a shard header (the object's first :func:`header_length` bytes or more)."""
    total = header_length(head)
    if len(head) < total:
        raise ShardFormatError(f"shard header truncated: have {len(head)} of {total} bytes")
    try:
        header = json_dict(load_json(head[8:total], "shard header", MAX_HEADER_BYTES), "shard header")
        meta = json_dict(header["__metadata__"], "shard header __metadata__")
        if meta.get("format") != FORMAT_VERSION:
            raise ShardFormatError(f"shard format {show(meta.get('format'))}, expected {FORMAT_VERSION!r}")
        hsx = json_str(meta["hsx"], "__metadata__.hsx")
        doc = json_dict(load_json(hsx.encode(), "shard index (__metadata__.hsx)", MAX_HEADER_BYTES), "shard index")
        samples = tuple(SampleEntry.from_json(s) for s in json_list(doc["samples"], "shard samples"))
        shard_index = json_int(doc["shard"], "shard index", hi=MAX_SHARDS - 1)
    except ShardFormatError as exc:
        raise ShardFormatError(f"shard header is malformed: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ShardFormatError(f"shard header is malformed: {type(exc).__name__} {str(exc)[:200]}") from None
    _check_tiling(samples)
    return ShardHeader(shard_index, total, samples, checksum(head[:total]))


def _check_tiling(samples: Sequence[SampleEntry]) -> None:
    # Samples must tile the data section, and tensors their sample, so checksums cover every byte.
    offset = 0
    last = -1
    for s in samples:
        if s.index <= last:
            raise ShardFormatError(f"sample {s.index} out of order or duplicated in shard index")
        if s.offset != offset or s.length % ALIGN:
            raise ShardFormatError(
                f"sample {s.index}: offset {s.offset} (expected {offset}) or length {s.length} breaks tiling"
            )
        inner = 0
        for t in s.tensors:
            if t.offset != inner or t.dtype not in _DTYPES or t.codec not in CODECS:
                raise ShardFormatError(
                    f"sample {s.index}: tensor {t.name} is misplaced or has unknown dtype/codec"
                )
            if t.codec == CODEC_RAW and t.length != t.raw_length:
                raise ShardFormatError(
                    f"sample {s.index}: raw tensor {t.name} length does not match its shape"
                )
            # A compressed tensor stores its n low bytes raw after the frame: n < stored length, so
            # decoding never yields more than twice what was read (a shape cannot ask for GiBs).
            if t.codec != CODEC_RAW and (t.dtype != "BF16" or t.num_values >= t.length):
                raise ShardFormatError(
                    f"sample {s.index}: tensor {t.name} of shape {list(t.shape)} cannot be "
                    f"{t.codec} in {t.length} bytes"
                )
            if t.codec == CODEC_FP8 and t.length != fp8.encoded_length(t.num_values, t.shape[0]):
                raise ShardFormatError(f"sample {s.index}: fp8 tensor {t.name} length does not match its shape")
            inner += t.length
        _check_shapes(s)
        if not 0 <= s.length - inner < ALIGN or {t.name for t in s.tensors} != set(TENSOR_ORDER):
            raise ShardFormatError(f"sample {s.index}: tensors do not fill the sample")
        offset += s.length
        last = s.index


def _check_shapes(s: SampleEntry) -> None:
    """The four tensors of a sample agree with each other and with seqLen (dtypes as the format says)."""
    by_name = {t.name: t for t in s.tensors}
    if set(by_name) != set(TENSOR_ORDER):
        raise ShardFormatError(f"sample {s.index}: tensors {sorted(by_name)}, expected {sorted(TENSOR_ORDER)}")
    seq = s.seq_len
    final = by_name[FINAL].shape
    hidden = final[1] if len(final) == 2 else 0
    aux = by_name[AUX].shape
    ok = (
        all(by_name[n].dtype == d for n, d in _LOGICAL_DTYPE.items())
        and by_name[INPUT_IDS].shape == (seq,)
        and by_name[LOSS_MASK].shape == (seq,)
        and len(final) == 2
        and final[0] == seq
        and hidden >= 1
        and len(aux) == 2
        and aux[0] == seq
        and aux[1] >= hidden
        and aux[1] % hidden == 0
    )
    if not ok:
        shapes = {n: list(t.shape) for n, t in by_name.items()}
        raise ShardFormatError(f"sample {s.index}: tensor shapes {shapes} do not fit seqLen {seq}")
