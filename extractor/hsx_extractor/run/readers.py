"""What the extraction reader hands the worker (engine.ReaderEvent), in dataset order: the rows of the
uncommitted shards this process leases (run/leases.py) of a stored plan, or of a plan still being made
(run/planning.py), then those it takes over. Each runs in the worker's reader thread."""

from __future__ import annotations

from collections.abc import Callable

from hsx_extractor.config import ExtractConfig
from hsx_extractor.reasons import Reason
from hsx_extractor.run.consistency import Consistency
from hsx_extractor.run.dataset import Prepared, Rejected, dataset_rows
from hsx_extractor.run.engine import ReaderEvent, ShardResumed, ShardRow
from hsx_extractor.run.leases import Leases, work_left
from hsx_extractor.run.plan import RowWitness, ShardCut, ShardPlan
from hsx_extractor.run.planning import PlanAhead, PlanStopped
from hsx_extractor.run.regenerate import row_samples
from hsx_extractor.run.tokens import ChatTokenizer
from hsx_extractor.storage.store import Store

Reader = Callable[[Callable[[ReaderEvent], None]], None]


class LeaseDecisions:
    """Whether this process works on shard k, decided once, when the reader first meets the shard."""

    def __init__(self, leases: Leases) -> None:
        self.leases = leases
        self._decided: dict[int, bool] = {}

    def __call__(self, shard: int) -> bool:
        if shard not in self._decided:
            self._decided[shard] = shard in self.leases.worked or self.leases.claim(shard)
        return self._decided[shard]

    def decided(self, shard: int) -> bool | None:
        """The decision, None before the reader met the shard."""
        return self._decided.get(shard)


def routed(item: Prepared | Rejected, duplicate: bool, shard: int, consistency: Consistency | None) -> ShardRow:
    """The row as the worker gets it: a repeated id rejected, the first accepted rows of each shard
    picked for the consistency check."""
    if isinstance(item, Prepared) and duplicate:
        detail = f"id {item.sample_id!r} is used by an earlier row"
        item = Rejected(item.index, item.sample_id, Reason.DUPLICATE_ID, detail, item.line)
    if isinstance(item, Prepared) and consistency is not None:
        consistency.picks.offer(shard, item.index)
    return ShardRow(shard, item)


def read_cuts(
    cfg: ExtractConfig,
    tok: ChatTokenizer,
    plan: ShardPlan,
    consistency: Consistency | None,
    emit: Callable[[ReaderEvent], None],
    wanted: Callable[[int], bool],
) -> None:
    """One pass over the dataset: the rows of each shard of ``plan`` that ``wanted`` (asked at the shard's
    first row), each shard's cut first."""
    shard_of = [0] * plan.rows
    for k, (start, stop) in enumerate(plan.shards):
        shard_of[start:stop] = [k] * (stop - start)
    sent: set[int] = set()
    witness = RowWitness()  # every planned shard's rows, wanted or not, are read here anyway
    for k in range(len(plan.shards)):
        witness.expect(plan.cut(k))

    def want(index: int) -> bool:
        return index < plan.rows and wanted(shard_of[index])

    rows = witness.rows(dataset_rows(cfg))
    for item in row_samples(cfg, rows, tok, want):
        if item.index >= plan.rows:
            return
        shard = shard_of[item.index]
        if not wanted(shard):
            continue
        if shard not in sent:  # every row of the shard is known: the worker may seal it once full
            sent.add(shard)
            emit(plan.cut(shard))
        emit(routed(item, item.index in plan.duplicates, shard, consistency))


def planned_reader(
    cfg: ExtractConfig,
    tok: ChatTokenizer,
    plan: ShardPlan,
    committed: set[int],
    consistency: Consistency | None,
    leases: Leases,
) -> Reader:
    """The rows of a stored plan's uncommitted shards this process leases as it meets them, then of
    those it takes over (run/leases.work_left)."""
    mine = LeaseDecisions(leases)

    def read(emit: Callable[[ReaderEvent], None]) -> None:
        leases.scan()
        read_cuts(cfg, tok, plan, consistency, emit, lambda k: k not in committed and mine(k))
        work_left(leases, len(plan.shards), lambda taken: read_cuts(cfg, tok, plan, consistency, emit,
                                                                    taken.__contains__))  # fmt: skip

    return read


def planning_reader(
    cfg: ExtractConfig,
    store: Store,
    tok: ChatTokenizer,
    ahead: PlanAhead,
    committed: set[int],
    consistency: Consistency | None,
    leases: Leases,
) -> Reader:
    """The rows of the uncommitted shards this process leases as the planning thread places them, each
    shard's cut as soon as it is made; once the plan is stored, those it takes over."""
    mine = LeaseDecisions(leases)

    def read(emit: Callable[[ReaderEvent], None]) -> None:
        leases.scan()
        seen = 0  # cuts handed on
        witness = RowWitness()  # the rows read here against the planning thread's digests
        # Cuts of shards the reader has not reached yet (the planning thread runs ahead): a shard is
        # leased at its first row, never earlier, so a process holds only what it works on.
        early: dict[int, ShardCut] = {}

        def hand_cuts() -> None:
            nonlocal seen
            for cut in ahead.cuts(seen):
                seen += 1
                witness.expect(cut)
                if cut.shard in committed:  # the planning thread checked it against the cut
                    emit(ShardResumed(cut.shard, store.get_commit(cut.shard), cut.stop - cut.start))
                elif mine.decided(cut.shard):
                    emit(cut)
                elif mine.decided(cut.shard) is None:
                    early[cut.shard] = cut

        def wanted(index: int) -> bool:
            hand_cuts()  # a full shard is sealed as soon as its cut is known, not at the next row sent
            placed = ahead.placement(index)
            return placed is not None and placed.shard not in committed and mine(placed.shard)

        try:
            rows = witness.rows(dataset_rows(cfg))
            for item in row_samples(cfg, rows, tok, wanted):
                placed = ahead.placement(item.index)
                if placed is None:
                    break
                # With expandTurns a row's samples may straddle two shards: only this replica's
                # uncommitted ones go on.
                if placed.shard in committed or not mine(placed.shard):
                    continue
                hand_cuts()
                if placed.shard in early:
                    emit(early.pop(placed.shard))
                emit(routed(item, placed.duplicate, placed.shard, consistency))
            plan = ahead.plan()
        except PlanStopped:
            return
        hand_cuts()
        work_left(leases, len(plan.shards), lambda taken: read_cuts(cfg, tok, plan, consistency, emit,
                                                                    taken.__contains__))  # fmt: skip

    return read
