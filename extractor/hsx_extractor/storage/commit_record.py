"""The commit record (``hsx-commit/1``, docs/format.md): what a sealed shard is, and the
quarantined rows of its range. Written once per shard after its object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from hsx_extractor.storage.shard_format import ShardFormatError

COMMIT_VERSION: Final = "hsx-commit/1"


@dataclass(frozen=True)
class QuarantineEntry:
    """A dataset row that produced no sample, and why."""

    index: int  # position in the dataset
    sample_id: str | None  # the row's id, when it could be read
    reason: str  # short machine-readable reason (too_long, no_dump, mismatch_length, ...)
    detail: str  # human-readable explanation

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "sampleId": self.sample_id, "reason": self.reason, "detail": self.detail}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> QuarantineEntry:
        return cls(int(obj["index"]), obj.get("sampleId"), str(obj["reason"]), str(obj.get("detail", "")))


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

    def to_json(self) -> dict[str, Any]:
        return {
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

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ShardCommit:
        if obj.get("format") != COMMIT_VERSION:
            raise ShardFormatError(f"commit record format {obj.get('format')!r}, expected {COMMIT_VERSION!r}")
        try:
            indices = tuple(int(i) for i in obj["samples"])
            quarantine = tuple(QuarantineEntry.from_json(q) for q in obj["quarantined"])
            return cls(
                shard_index=int(obj["shard"]),
                samples=len(indices),
                quarantined=len(quarantine),
                bytes_stored=int(obj["bytesStored"]),
                bytes_raw=int(obj["bytesRaw"]),
                key=str(obj["key"]),
                checksum=str(obj["checksum"]),
                start=int(obj["start"]),
                stop=int(obj["stop"]),
                sample_indices=indices,
                quarantine=quarantine,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardFormatError(f"commit record is malformed: {exc}") from exc
