"""The shard plan: which dataset positions go into which shard. The one place that decides it.

Shard k holds a fixed, contiguous range of row indices, cut so each shard holds about
``shardTargetBytes`` of raw hidden states. The plan is stored once (plan.json, write-if-absent),
so restarts and replicas all use the same ranges and a rerun produces the same shard keys.

The plan also records what it was made from, so a resume cannot mix two datasets: the dataset's
size and ETag (or mtime) and, per shard, a digest of its rows' raw bytes. When the dataset's stat
differs at resume, the rows are hashed again and every shard whose rows changed is named.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    # Per shard, the digest of its rows' raw bytes (shard_digests); empty in plans made without them.
    digests: tuple[str, ...] = ()
    # The dataset's stat when planned (storage.store.uri_stat): size and ETag or mtime.
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
                {"index": k, "start": a, "stop": b, **({"digest": self.digests[k]} if self.digests else {})}
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
        digests = tuple(str(s["digest"]) for s in shards) if all("digest" in s for s in shards) else ()
        return cls(
            identity=dict(data["identity"]),
            rows=int(data["rows"]),
            shards=[(int(s["start"]), int(s["stop"])) for s in shards],
            duplicates=frozenset(int(i) for i in data.get("duplicates", [])),
            digests=digests,
            source=dict(data.get("source") or {}),
        )

    def changed_shards(self, row_digests: Sequence[int]) -> list[str]:
        """What differs between the planned rows and ``row_digests`` of the dataset now (empty: nothing)."""
        changes = []
        if len(row_digests) < self.rows:
            changes.append(f"the dataset now has {len(row_digests)} rows, the plan {self.rows}")
        now = shard_digests(self.shards, row_digests)
        for k, ((start, stop), planned, current) in enumerate(zip(self.shards, self.digests, now, strict=True)):
            if planned != current:
                changes.append(f"shard {k} (rows {start}-{stop - 1}) changed")
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


def row_digest(raw: bytes) -> int:
    """The digest of one dataset row's raw bytes (a line, without its newline)."""
    return xxhash.xxh3_64_intdigest(raw)


def hashed(lines: Iterable[bytes], digests: list[int]) -> Iterator[bytes]:
    """``lines`` unchanged, appending each one's row_digest to ``digests`` as it is read."""
    for line in lines:
        digests.append(row_digest(line))
        yield line


def shard_digests(shards: Sequence[tuple[int, int]], row_digests: Sequence[int]) -> list[str]:
    """Per shard, one digest over its rows' digests (rows missing from ``row_digests`` count as absent)."""
    out = []
    for start, stop in shards:
        h = xxhash.xxh3_64()
        h.update(array("Q", row_digests[start:stop]).tobytes())
        h.update(array("Q", [max(0, min(stop, len(row_digests)) - start)]).tobytes())
        out.append(h.hexdigest())
    return out


def build_plan(
    identity: dict[str, Any],
    lengths: Iterable[int | None],
    ids: Iterable[str | None],
    num_aux: int,
    hidden_size: int,
    target_bytes: int,
    row_digests: Sequence[int] = (),
    source: dict[str, Any] | None = None,
) -> ShardPlan:
    """The plan from the pre-pass: per row its token count and id (None when rejected). Pure."""
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
    digests = tuple(shard_digests(shards, row_digests)) if row_digests else ()
    return ShardPlan(identity, len(weights), shards, frozenset(duplicates), digests, dict(source or {}))


def planned_shards(data: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(shard index, start, stop)`` from a stored plan.json, checked only as far as verify needs."""
    try:
        shards = [(int(s["index"]), int(s["start"]), int(s["stop"])) for s in data["shards"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanMismatch(f"plan.json needs shards: [{{index, start, stop}}, ...]: {exc}") from exc
    if len({k for k, _, _ in shards}) != len(shards):
        raise PlanMismatch("plan.json lists a shard twice")
    return sorted(shards)
