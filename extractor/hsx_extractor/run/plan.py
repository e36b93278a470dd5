"""The shard plan: which dataset positions go into which shard. The one place that decides it.

Shard k holds a fixed, contiguous range of row indices, cut so each shard holds about
``shardTargetBytes`` of raw hidden states. The plan is stored once (plan.json, write-if-absent),
so restarts and replicas all use the same ranges and a rerun produces the same shard keys.

The plan also records what it was made from, so a resume cannot mix two datasets: the dataset's
size and ETag (or mtime) and, per shard, the file lines its samples come from and a digest of
those rows' raw bytes. When the dataset's stat differs at resume, the rows are hashed again and
every shard whose rows changed is named.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import xxhash

PLAN_NAME = "plan.json"
PLAN_VERSION = 1


class PlanMismatch(ValueError):
    """A stored plan was made with other settings than this run's."""


def bytes_per_sample(length: int, num_aux: int, hidden_size: int) -> int:
    """Raw bytes a sample of ``length`` tokens takes: bf16 aux + final states, int32 ids, uint8 mask."""
    return length * ((num_aux + 1) * hidden_size * 2 + 4 + 1)


def cut_shards(sample_bytes: Sequence[int], target_bytes: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges covering every row; a shard closes once it reaches the target.

    Rejected rows weigh 0 bytes but still belong to a shard (their quarantine entry lives there).
    """
    shards: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, nbytes in enumerate(sample_bytes):
        size += nbytes
        if size >= target_bytes:
            shards.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(sample_bytes):
        shards.append((start, len(sample_bytes)))
    return shards


def replica_shards(num_shards: int, replica_index: int, replica_count: int) -> list[int]:
    """Shards replica ``r`` of ``n`` owns: ``k % n == r``."""
    if not 0 <= replica_index < replica_count:
        raise ValueError(f"replicaIndex {replica_index} is outside [0, {replica_count})")
    return [k for k in range(num_shards) if k % replica_count == replica_index]


@dataclass(frozen=True)
class ShardPlan:
    """What plan.json holds."""

    # Settings the plan depends on; a restart with different ones must not reuse it.
    identity: dict[str, Any]
    rows: int
    shards: list[tuple[int, int]]
    # Rows rejected as duplicate ids (first accepted occurrence wins); needs the whole dataset to know.
    duplicates: frozenset[int] = field(default_factory=frozenset)
    # Per shard, the first and last file line its samples come from, and the digest of those
    # rows' raw bytes (shard_digests); empty in plans made without them.
    lines: tuple[tuple[int, int], ...] = ()
    digests: tuple[str, ...] = ()
    # The dataset's stat when planned (storage.uris.uri_stat): size and ETag or mtime.
    source: dict[str, Any] = field(default_factory=dict)

    def shard_range(self, shard: int) -> range:
        start, end = self.shards[shard]
        return range(start, end)

    def shard_of(self) -> dict[int, int]:
        """Row index -> shard index, for the rows of every shard."""
        return {i: k for k, (start, end) in enumerate(self.shards) for i in range(start, end)}

    def planned(self) -> list[tuple[int, int, int]]:
        """``(shard index, start, stop)`` of every shard, as the store's finalize takes them."""
        return [(k, a, b) for k, (a, b) in enumerate(self.shards)]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "identity": self.identity,
            "rows": self.rows,
            "shards": [
                {
                    "index": k,
                    "start": a,
                    "stop": b,
                    **({"lines": list(self.lines[k]), "digest": self.digests[k]} if self.digests else {}),
                }
                for k, (a, b) in enumerate(self.shards)
            ],
            "duplicates": sorted(self.duplicates),
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardPlan:
        if data.get("version") != PLAN_VERSION:
            raise PlanMismatch(f"plan.json version {data.get('version')!r}, expected {PLAN_VERSION}")
        shards = sorted(data["shards"], key=lambda s: s["index"])
        known = all("digest" in s and "lines" in s for s in shards)
        digests = tuple(str(s["digest"]) for s in shards) if known else ()
        lines = tuple((int(s["lines"][0]), int(s["lines"][1])) for s in shards) if known else ()
        return cls(
            identity=dict(data["identity"]),
            rows=int(data["rows"]),
            shards=[(int(s["start"]), int(s["stop"])) for s in shards],
            duplicates=frozenset(int(i) for i in data.get("duplicates", [])),
            lines=lines,
            digests=digests,
            source=dict(data.get("source") or {}),
        )

    @property
    def last_line(self) -> int:
        return max((last for _, last in self.lines), default=0)

    def changed_shards(self, line_digests: Mapping[int, int]) -> list[str]:
        """What differs between the planned rows and the dataset's now, by line (empty: nothing)."""
        changes = []
        seen = max(line_digests, default=0)
        if seen < self.last_line:
            changes.append(f"the dataset now ends at line {seen}, the plan reaches line {self.last_line}")
        now = shard_digests(self.lines, line_digests)
        for k, ((start, stop), (first, last), planned, current) in enumerate(
            zip(self.shards, self.lines, self.digests, now, strict=True)
        ):
            if planned != current:
                changes.append(f"shard {k} (samples {start}-{stop - 1}, lines {first}-{last}) changed")
        return changes

    def check_identity(self, identity: dict[str, Any]) -> None:
        diffs = [
            f"{key}: stored {self.identity.get(key)!r}, now {identity.get(key)!r}"
            for key in sorted(set(identity) | set(self.identity))
            if self.identity.get(key) != identity.get(key)
        ]
        if diffs:
            raise PlanMismatch(
                "this run's output was planned with other settings (" + "; ".join(diffs) + "); "
                "use a new runId or the original settings"
            )


class Row(Protocol):
    """A dataset row as read: its file line and its raw bytes (or a decoded Parquet row)."""

    @property
    def line(self) -> int: ...

    @property
    def data(self) -> bytes | dict[str, Any]: ...


R = TypeVar("R", bound=Row)


def row_digest(data: bytes | dict[str, Any]) -> int:
    """The digest of one dataset row: its raw bytes, or a Parquet row's canonical JSON."""
    if not isinstance(data, bytes | bytearray):
        data = json.dumps(data, sort_keys=True, default=str).encode()
    return xxhash.xxh3_64_intdigest(data)


def hashed(rows: Iterable[R], digests: dict[int, int]) -> Iterator[R]:
    """``rows`` unchanged, recording each one's row_digest under its line as it is read."""
    for row in rows:
        digests[row.line] = row_digest(row.data)
        yield row


def shard_digests(shard_lines: Sequence[tuple[int, int]], line_digests: Mapping[int, int]) -> list[str]:
    """Per shard, one digest over the digests of the rows on its lines ``[first, last]``, and their count."""
    out = []
    for first, last in shard_lines:
        found = [line_digests[n] for n in range(first, last + 1) if n in line_digests]
        h = xxhash.xxh3_64()
        h.update(array("Q", found).tobytes())
        h.update(array("Q", [len(found)]).tobytes())
        out.append(h.hexdigest())
    return out


def build_plan(
    identity: dict[str, Any],
    lengths: Iterable[int | None],
    ids: Iterable[str | None],
    num_aux: int,
    hidden_size: int,
    target_bytes: int,
    sample_lines: Sequence[int] = (),
    line_digests: Mapping[int, int] | None = None,
    source: dict[str, Any] | None = None,
) -> ShardPlan:
    """The plan from the pre-pass: per sample its token count and id (None when rejected), its file
    line and each line's row digest. Pure."""
    seen: set[str] = set()
    duplicates: set[int] = set()
    weights: list[int] = []
    for index, (length, sample_id) in enumerate(zip(lengths, ids, strict=True)):
        if length is None or sample_id is None:
            weights.append(0)
            continue
        if sample_id in seen:
            duplicates.add(index)
            weights.append(0)
            continue
        seen.add(sample_id)
        weights.append(bytes_per_sample(length, num_aux, hidden_size))
    shards = cut_shards(weights, target_bytes)
    lines: tuple[tuple[int, int], ...] = ()
    digests: tuple[str, ...] = ()
    if sample_lines and line_digests is not None:
        lines = tuple((sample_lines[a], sample_lines[b - 1]) for a, b in shards)
        digests = tuple(shard_digests(lines, line_digests))
    return ShardPlan(
        identity, len(weights), shards, frozenset(duplicates), lines, digests, dict(source or {})
    )


def planned_shards(data: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(shard index, start, stop)`` from a stored plan.json, checked only as far as verify needs."""
    try:
        shards = [(int(s["index"]), int(s["start"]), int(s["stop"])) for s in data["shards"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanMismatch(f"plan.json needs shards: [{{index, start, stop}}, ...]: {exc}") from exc
    if len({k for k, _, _ in shards}) != len(shards):
        raise PlanMismatch("plan.json lists a shard twice")
    return sorted(shards)
