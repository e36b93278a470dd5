"""The shard plan: deterministic ranges, replica assignment, stored form, identity checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hsx_extractor.run.plan import (
    PlanMismatch,
    Planner,
    ShardPlan,
    build_plan,
    bytes_per_sample,
    cut_shards,
    planned_shards,
)


def test_bytes_per_sample_counts_aux_final_ids_and_mask() -> None:
    # 10 tokens, 3 aux layers + final of hidden 64 in bf16, int32 id, uint8 mask.
    assert bytes_per_sample(10, 3, 64) == 10 * (4 * 64 * 2 + 4 + 1)


def test_cut_shards_closes_at_target() -> None:
    assert cut_shards([4, 4, 4, 4, 4], 8) == [(0, 2), (2, 4), (4, 5)]
    assert cut_shards([0, 0, 9, 0], 8) == [(0, 3), (3, 4)]
    assert cut_shards([1, 1], 100) == [(0, 2)]
    assert cut_shards([], 8) == []


@given(st.lists(st.integers(0, 50), max_size=60), st.integers(1, 120))
def test_cut_shards_tiles_every_row_in_order(weights: list[int], target: int) -> None:
    shards = cut_shards(weights, target)
    flat = [i for a, b in shards for i in range(a, b)]
    assert flat == list(range(len(weights)))
    assert all(b > a for a, b in shards)
    # Every shard but the last reached the target; none went past it by more than its last row.
    for a, b in shards[:-1]:
        assert sum(weights[a:b]) >= target > sum(weights[a : b - 1])


def test_plan_round_trips_in_the_layout_the_store_finalizes() -> None:
    identity = {"dataset": "d.jsonl", "hiddenSize": 64}
    plan = build_plan(
        identity, [10, None, 10, 10, 10], ["a", None, "b", "a", "c"], 3, 64, 2 * bytes_per_sample(10, 3, 64)
    )
    assert plan.duplicates == {3}
    assert plan.shards == [(0, 3), (3, 5)]  # rejected rows and the duplicate weigh nothing
    stored = plan.to_json()
    assert planned_shards(stored) == [(0, 0, 3), (1, 3, 5)]
    again = ShardPlan.from_json(stored)
    assert again == plan
    assert list(again.shard_range(1)) == [3, 4]


def test_plan_identity_mismatch_names_the_fields() -> None:
    plan = ShardPlan({"maxLength": 512, "dataset": "a"}, 1, [(0, 1)])
    plan.check_identity({"maxLength": 512, "dataset": "a"})
    with pytest.raises(PlanMismatch, match=r"maxLength: stored 512, now 256.*new runId"):
        plan.check_identity({"maxLength": 256, "dataset": "a"})


@given(
    st.lists(st.tuples(st.one_of(st.none(), st.integers(1, 40)), st.sampled_from("abcdefgh")), max_size=60),
    st.integers(1, 20_000),
)
def test_planner_cuts_each_shard_when_its_last_row_is_read(rows: list[tuple[int | None, str]], target: int) -> None:
    """Row by row, the planner names each row's shard at once and each shard's cut right after its
    last row; what it finishes with is the plan build_plan makes from the whole dataset."""
    lengths = [n for n, _ in rows]
    ids = [None if n is None else i for n, i in rows]
    lines = [2 * k + 1 for k in range(len(rows))]
    digests = {line: hash(line) & 0xFFFF for line in lines}
    planner = Planner({"d": 1}, 3, 8, target, digests)
    cuts, placed = [], []
    for length, sample_id, line in zip(lengths, ids, lines, strict=True):
        p = planner.add(length, sample_id, line)
        placed.append(p.shard)
        if p.cut is not None:
            assert p.cut.stop == len(placed)  # cut right after its last row
            cuts.append(p.cut)
    last, plan = planner.finish(lines[-1] if lines else 0)
    if last is not None:
        cuts.append(last)
    whole = build_plan({"d": 1}, lengths, ids, 3, 8, target, lines, digests)
    assert plan == whole and cuts == [plan.cut(k) for k in range(len(plan.shards))]
    assert placed == [k for k, (a, b) in enumerate(plan.shards) for _ in range(a, b)]
    if cuts:
        assert all(c.source_json() is not None for c in cuts)
