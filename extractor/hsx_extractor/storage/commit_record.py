"""The commit record (``hsx-commit/1``, docs/format.md): what a sealed shard is, and the
quarantined rows of its range. Written once per shard after its object; read back untrusted."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Final

from hsx_extractor.storage.layer_stats import check_layer_norms
from hsx_extractor.storage.layout import MAX_SHARDS
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
from hsx_extractor.storage.token_counts import counts_from_json, counts_to_json

COMMIT_VERSION: Final = "hsx-commit/1"
MAX_COMMIT_BYTES: Final = 100_000_000  # a commit record lists no more than its shard's header


@dataclass(frozen=True)
class QuarantineEntry:
    """A dataset row that produced no sample, and why."""

    index: int  # position in the dataset
    sample_id: str | None  # the row's id, when it could be read
    reason: str  # short machine-readable reason (too_long, no_dump, mismatch_length, ...)
    detail: str  # human-readable explanation
    line: int | None = None  # the row's 1-based line in the dataset file (Parquet: row number)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "sampleId": self.sample_id,
            "reason": self.reason,
            "detail": self.detail,
        }
        if self.line is not None:
            out["line"] = self.line
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> QuarantineEntry:
        obj = json_dict(obj, "quarantine entry")
        sample_id = obj.get("sampleId")
        line = obj.get("line")
        return cls(
            json_int(obj["index"], "quarantine index", hi=MAX_INDEX),
            None if sample_id is None else json_str(sample_id, "quarantine sampleId"),
            json_str(obj["reason"], "quarantine reason"),
            json_str(obj.get("detail", ""), "quarantine detail"),
            None if line is None else json_int(line, "quarantine line", lo=1, hi=1 << 62),
        )


@dataclass(frozen=True)
class ShardCommit:
    """What a sealed shard is; the commit record is this as JSON."""

    shard_index: int
    samples: int  # samples stored
    quarantined: int  # rows of this shard that are quarantined
    bytes_stored: int  # object size
    bytes_raw: int  # uncompressed size of every stored tensor
    key: str  # object key (relative to the store root)
    checksum: str  # shard checksum: xxh3-64 of the header, which lists every sample's xxh3-64
    start: int = 0  # first dataset index of the shard
    stop: int = 0  # one past the last
    sample_indices: tuple[int, ...] = field(default=(), repr=False)
    quarantine: tuple[QuarantineEntry, ...] = field(default=(), repr=False)
    # Token id -> occurrences where the loss mask is 1, over the stored samples; None in records
    # written before hsx counted them.
    token_counts: dict[int, int] | None = field(default=None, repr=False)
    # Derived facts, not content (two identical writers may round them differently):
    # per-layer token-norm statistics (storage.layer_stats) and the consistency check's results.
    layer_norms: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    consistency: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # The file lines the shard's rows come from, their digest and the plan settings' digest
    # ({"lines": [first, last], "digest", "plan"}),
    # kept when the shard was cut while the plan was being made: before plan.json exists, this is
    # what tells a resumed run that the dataset changed under a committed shard.
    source: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": COMMIT_VERSION,
            "shard": self.shard_index,
            "key": self.key,
            "checksum": self.checksum,
            "bytesStored": self.bytes_stored,
            "bytesRaw": self.bytes_raw,
            "start": self.start,
            "stop": self.stop,
            "samples": list(self.sample_indices),
            "quarantined": [q.to_json() for q in self.quarantine],
        }
        if self.token_counts is not None:
            out["tokenCounts"] = counts_to_json(self.token_counts)
        if self.layer_norms is not None:
            out["layerNorms"] = self.layer_norms
        if self.consistency is not None:
            out["consistency"] = self.consistency
        if self.source is not None:
            out["source"] = self.source
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ShardCommit:
        """A commit record, checked: every field of its type and in bounds, and the listed samples
        and quarantined rows (each sorted, disjoint) exactly cover ``[start, stop)``, so nothing
        built from a record (a range, a set) can be larger than the record itself."""
        if not isinstance(obj, dict):
            raise ShardFormatError(f"commit record must be a JSON object, got {show(obj)}")
        if obj.get("format") != COMMIT_VERSION:
            raise ShardFormatError(f"commit record format {show(obj.get('format'))}, expected {COMMIT_VERSION!r}")
        try:
            start = json_int(obj["start"], "start", hi=MAX_INDEX)
            stop = json_int(obj["stop"], "stop", lo=start, hi=MAX_INDEX)
            indices = tuple(json_int(i, "sample index", start, stop - 1) for i in json_list(obj["samples"], "samples"))
            quarantine = tuple(QuarantineEntry.from_json(q) for q in json_list(obj["quarantined"], "quarantined"))
            key = json_str(obj["key"], "key")
            if not 0 < len(key) <= 1024:
                raise ShardFormatError(f"key of {len(key)} characters")
            commit = cls(
                shard_index=json_int(obj["shard"], "shard", hi=MAX_SHARDS - 1),
                samples=len(indices),
                quarantined=len(quarantine),
                bytes_stored=json_int(obj["bytesStored"], "bytesStored"),
                bytes_raw=json_int(obj["bytesRaw"], "bytesRaw"),
                key=key,
                checksum=json_hex16(obj["checksum"], "checksum"),
                start=start,
                stop=stop,
                sample_indices=indices,
                quarantine=quarantine,
                token_counts=None if obj.get("tokenCounts") is None else counts_from_json(obj["tokenCounts"]),
                layer_norms=None if obj.get("layerNorms") is None else check_layer_norms(obj["layerNorms"]),
                consistency=None if obj.get("consistency") is None else _consistency(obj["consistency"], start, stop),
                source=None if obj.get("source") is None else _source(obj["source"]),
            )
        except ValueError as exc:  # ShardFormatError included
            raise ShardFormatError(f"commit record is malformed: {exc}") from None
        except KeyError as exc:
            raise ShardFormatError(f"commit record is malformed: no field {exc}") from None
        q_indices = [q.index for q in quarantine]
        if any(not start <= i < stop for i in q_indices):
            raise ShardFormatError(f"commit record is malformed: a quarantined index is outside [{start}, {stop})")
        for name, seq in (("samples", indices), ("quarantined", q_indices)):
            if any(a >= b for a, b in itertools.pairwise(seq)):
                raise ShardFormatError(f"commit record is malformed: {name} are not sorted and distinct")
        if len(indices) + len(q_indices) != stop - start or not set(indices).isdisjoint(q_indices):
            raise ShardFormatError(
                f"commit record is malformed: {len(indices)} samples and {len(q_indices)} quarantined "
                f"rows do not cover [{start}, {stop}) exactly"
            )
        return commit

    def content(self) -> tuple[Any, ...]:
        """What the record says about the shard's content: the object (key, checksum over every
        sample's checksum, sizes), the range, the stored samples and which rows are quarantined
        and why. Not the quarantine ``detail``: free text that may name the writer's request id,
        so two writers doing identical work would otherwise disagree. Not the token counts either:
        they are a function of the samples, whose bytes the checksum already covers."""
        return (
            self.shard_index,
            self.key,
            self.checksum,
            self.bytes_stored,
            self.bytes_raw,
            self.start,
            self.stop,
            self.sample_indices,
            tuple((q.index, q.sample_id, q.reason) for q in self.quarantine),
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ShardCommit:
        """A commit record from its stored bytes (bounded parse, then :meth:`from_json`)."""
        return cls.from_json(load_json(data, "commit record", MAX_COMMIT_BYTES))


def _consistency(obj: Any, start: int, stop: int) -> dict[str, Any]:
    """A stored ``consistency`` value, checked: indices of checked and failed requests in the shard."""
    obj = json_dict(obj, "consistency")
    checked = [json_int(i, "checked index", start, stop - 1) for i in json_list(obj["checked"], "checked")]
    failed = [json_int(i, "failed index", start, stop - 1) for i in json_list(obj["failed"], "failed")]
    worst = obj.get("maxLogprobError", 0.0)
    if not set(failed) <= set(checked) or not isinstance(worst, int | float) or isinstance(worst, bool):
        raise ShardFormatError("consistency: failed requests must be checked ones, maxLogprobError a number")
    return {"checked": checked, "failed": failed, "maxLogprobError": worst}


def _source(obj: Any) -> dict[str, Any]:
    """A stored ``source`` value, checked: the first and last file line and a 16-hex-digit digest."""
    obj = json_dict(obj, "source")
    lines = json_list(obj["lines"], "source lines")
    if len(lines) != 2:
        raise ShardFormatError(f"source lines must be [first, last], got {len(lines)} values")
    first = json_int(lines[0], "source first line", hi=1 << 62)
    last = json_int(lines[1], "source last line", lo=first, hi=1 << 62)
    source = {"lines": [first, last], "digest": json_hex16(obj["digest"], "source digest")}
    if obj.get("plan") is not None:
        source["plan"] = json_hex16(obj["plan"], "source plan")
    return source
