"""What the extraction reader hands the worker (engine.ReaderEvent), in dataset order: the rows of this
replica's uncommitted shards of a stored plan, or of a plan still being made (run/planning.py). Each runs in
the worker's reader thread."""

from __future__ import annotations

from collections.abc import Callable

from hsx_extractor.config import ExtractConfig
from hsx_extractor.reasons import Reason
from hsx_extractor.run.consistency import Consistency
from hsx_extractor.run.dataset import Prepared, Rejected, dataset_rows, read_samples
from hsx_extractor.run.engine import ReaderEvent, ShardResumed, ShardRow
from hsx_extractor.run.plan import RowWitness, ShardCut, ShardPlan, replica_owns
from hsx_extractor.run.planning import PlanAhead, PlanStopped
from hsx_extractor.run.tokens import ChatTokenizer
from hsx_extractor.storage.store import Store

Reader = Callable[[Callable[[ReaderEvent], None]], None]


def owned_by(cfg: ExtractConfig) -> Callable[[int], bool]:
    """Whether shard k is this replica's (plan.replica_owns)."""
    return lambda shard: replica_owns(shard, cfg.replicaIndex, cfg.replicaCount)


def routed(item: Prepared | Rejected, duplicate: bool, shard: int, consistency: Consistency | None) -> ShardRow:
    """The row as the worker gets it: a repeated id rejected, the first accepted rows of each shard
    picked for the consistency check."""
    if isinstance(item, Prepared) and duplicate:
        detail = f"id {item.sample_id!r} is used by an earlier row"
        item = Rejected(item.index, item.sample_id, Reason.DUPLICATE_ID, detail, item.line)
    if isinstance(item, Prepared) and consistency is not None:
        consistency.picks.offer(shard, item.index)
    return ShardRow(shard, item)


def planned_reader(
    cfg: ExtractConfig, tok: ChatTokenizer, plan: ShardPlan, cuts: list[ShardCut], consistency: Consistency | None
) -> Reader:
    """The rows of a stored plan's shards ``cuts`` (this replica's uncommitted ones), each cut first."""
    d = cfg.dataset
    shard_of = {i: c.shard for c in cuts for i in range(c.start, c.stop)}

    def read(emit: Callable[[ReaderEvent], None]) -> None:
        for cut in cuts:  # every shard's rows are known: the worker may seal one as soon as it is full
            emit(cut)
        witness = RowWitness()  # every planned shard's rows, this replica's or not, are read here anyway
        for k in range(len(plan.shards)):
            witness.expect(plan.cut(k))
        rows = witness.rows(dataset_rows(cfg))
        wanted = shard_of.__contains__
        for item in read_samples(rows, tok, d.maxLength, d.format, d.limit, d.expandTurns, wanted):
            if item.index >= plan.rows:
                return
            if item.index in shard_of:
                emit(routed(item, item.index in plan.duplicates, shard_of[item.index], consistency))

    return read


def planning_reader(
    cfg: ExtractConfig,
    store: Store,
    tok: ChatTokenizer,
    ahead: PlanAhead,
    committed: set[int],
    consistency: Consistency | None,
) -> Reader:
    """The rows of this replica's uncommitted shards as the planning thread places them, each shard's
    cut as soon as it is made, and the totals once the plan is stored."""
    d = cfg.dataset
    mine = owned_by(cfg)

    def read(emit: Callable[[ReaderEvent], None]) -> None:
        seen = 0  # cuts handed on
        witness = RowWitness()  # the rows read here against the planning thread's digests

        def hand_cuts() -> None:
            nonlocal seen
            for cut in ahead.cuts(seen):
                seen += 1
                witness.expect(cut)
                if not mine(cut.shard):
                    continue
                if cut.shard not in committed:
                    emit(cut)
                    continue
                # The planning thread checked it against the cut.
                emit(ShardResumed(store.get_commit(cut.shard), cut.stop - cut.start))

        def wanted(index: int) -> bool:
            hand_cuts()  # a full shard is sealed as soon as its cut is known, not at the next row sent
            placed = ahead.placement(index)
            return placed is not None and mine(placed.shard) and placed.shard not in committed

        try:
            rows = witness.rows(dataset_rows(cfg))
            for item in read_samples(rows, tok, d.maxLength, d.format, d.limit, d.expandTurns, wanted):
                placed = ahead.placement(item.index)
                if placed is None:
                    break
                # With expandTurns a row's samples may straddle two shards: only this replica's
                # uncommitted ones go on.
                if not mine(placed.shard) or placed.shard in committed:
                    continue
                hand_cuts()
                emit(routed(item, placed.duplicate, placed.shard, consistency))
            ahead.plan()
        except PlanStopped:
            return
        hand_cuts()

    return read
