"""The shard plan: which dataset positions go into which shard. The one place that decides it.

Shard k holds a fixed, contiguous range of row indices, cut so each shard holds about
``shardTargetBytes`` of raw hidden states. The plan is stored once (plan.json, write-if-absent),
so restarts and replicas all use the same ranges and a rerun produces the same shard keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
            "shards": [{"index": k, "start": a, "stop": b} for k, (a, b) in enumerate(self.shards)],
            "duplicates": sorted(self.duplicates),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardPlan:
        if data.get("version") != PLAN_VERSION:
            raise PlanMismatch(f"plan.json version {data.get('version')!r}, expected {PLAN_VERSION}")
        return cls(
            identity=dict(data["identity"]),
            rows=int(data["rows"]),
            shards=[
                (int(s["start"]), int(s["stop"])) for s in sorted(data["shards"], key=lambda s: s["index"])
            ],
            duplicates=frozenset(int(i) for i in data.get("duplicates", [])),
        )

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


def build_plan(
    identity: dict[str, Any],
    lengths: Iterable[int | None],
    ids: Iterable[str | None],
    num_aux: int,
    hidden_size: int,
    target_bytes: int,
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
    return ShardPlan(identity, len(weights), cut_shards(weights, target_bytes), frozenset(duplicates))


def planned_shards(data: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(shard index, start, stop)`` from a stored plan.json, checked only as far as verify needs."""
    try:
        shards = [(int(s["index"]), int(s["start"]), int(s["stop"])) for s in data["shards"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanMismatch(f"plan.json needs shards: [{{index, start, stop}}, ...]: {exc}") from exc
    if len({k for k, _, _ in shards}) != len(shards):
        raise PlanMismatch("plan.json lists a shard twice")
    return sorted(shards)
