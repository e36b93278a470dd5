"""Planning ahead of extraction, for a run whose plan.json does not exist yet.

A thread reads and tokenizes the whole dataset once, placing each row in its shard (run.plan.Planner)
and storing plan.json when it reaches the end. Extraction does not wait for it: its reader asks
:meth:`PlanAhead.placement` for each row's shard, which is known as soon as the planning thread has
read that row, so the first request goes out within seconds of start instead of after a pass over the
whole dataset (minutes of idle GPUs for 37k long rows). Tokenizing runs twice, as it did with a
pre-pass: once here and once in the extraction reader, which skips rows of other replicas' and
committed shards.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from hsx_extractor.run.dataset import Prepared, Rejected
from hsx_extractor.run.failures import permanent
from hsx_extractor.run.plan import Planner, ShardCut, ShardPlan
from hsx_extractor.run.sources import OversizedRow, SourceRow, dataset_kind
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.store import Store


@dataclass(frozen=True)
class Placement:
    shard: int
    duplicate: bool  # its id repeats an earlier accepted row's


class ReadFraction:
    """How much of a plain JSONL dataset the planning pass has read, by bytes: before the row count is
    known it turns the rows placed so far into an estimate of the total (compressed files and Parquet:
    unknown, None)."""

    def __init__(self, uri: str, size: Callable[[], int | None]) -> None:
        """``size()``: the dataset's size in bytes, asked once, when first needed; a dataset that cannot
        be stat'ed is the reader's to report (a missing file is a DatasetError there), here only unknown."""
        self._size = size if dataset_kind(uri) == "jsonl" else None
        self.size: int | None = None
        self.read = 0

    def count(self, rows: Iterable[SourceRow]) -> Iterator[SourceRow]:
        for row in rows:
            data = row.data
            self.read += (len(data) if isinstance(data, bytes) else data.size if isinstance(data, OversizedRow) else 0) + 1
            yield row

    def fraction(self) -> float | None:
        if self._size is not None:
            ask, self._size = self._size, None
            try:
                self.size = ask() or None
            except Exception:  # unknown size: no estimate, never a failure
                self.size = None
        return min(self.read / self.size, 1.0) if self.size else None


class PlanStopped(Exception):
    """The run ended before the planning thread did."""


class PlanAhead:
    """The planning thread and what it has placed so far; every method but :meth:`start` and
    :meth:`stop` may block until the thread has read far enough."""

    def __init__(
        self,
        items: Callable[[], Iterable[Prepared | Rejected]],
        planner: Planner,
        finish: Callable[[Planner, int], ShardPlan],
        check_cut: Callable[[ShardCut], None] = lambda cut: None,
        counted: Callable[[int], bool] = lambda shard: True,
    ) -> None:
        """``items``: the dataset's samples in order; ``finish``: called in the thread after the last
        row with the planner and the last row's line, makes and stores the plan; ``check_cut``: called
        in the thread with each cut before anything sees it (it raises to stop the run); ``counted``:
        the shards whose rows :meth:`placed` counts (this replica's)."""
        self._items = items
        self._planner = planner
        self._finish = finish
        self._check_cut = check_cut
        self._counted = counted
        self._counts = [0, 0]  # rows and shards of counted shards placed so far
        self._cond = threading.Condition()
        self._shards = array("q")  # row index -> shard
        self._duplicates: set[int] = set()
        self._cuts: list[ShardCut] = []
        self._plan: ShardPlan | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hsx-plan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Let the thread end early (the run failed); it stops at its next row."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _run(self) -> None:
        line = 0
        try:
            for item in self._items():
                if self._stopping:
                    raise PlanStopped
                line = item.line or 0
                accepted = isinstance(item, Prepared)
                length = item.length if isinstance(item, Prepared) else None
                placed = self._planner.add(length, item.sample_id if accepted else None, line)
                if placed.cut is not None:
                    self._check_cut(placed.cut)
                with self._cond:
                    if self._counted(placed.shard):
                        self._counts[0] += 1
                        self._counts[1] += not self._shards or self._shards[-1] != placed.shard
                    self._shards.append(placed.shard)
                    if placed.duplicate:
                        self._duplicates.add(item.index)
                    if placed.cut is not None:
                        self._cuts.append(placed.cut)
                    self._cond.notify_all()
            plan = self._finish(self._planner, line)
            with self._cond:
                self._cuts = [plan.cut(k) for k in range(len(plan.shards))]
                self._plan = plan
                self._cond.notify_all()
        except BaseException as exc:  # handed to the reader that waits on it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Under the lock: until ``ready()``, the plan is made, or the thread failed."""
        while not ready() and self._plan is None and self._error is None and not self._stopping:
            self._cond.wait()
        if ready() or self._plan is not None:
            return
        if self._error is not None and not isinstance(self._error, PlanStopped):
            raise self._error
        raise PlanStopped

    def placement(self, index: int) -> Placement | None:
        """Row ``index``'s shard, once the thread read it; None past the dataset's end."""
        with self._cond:
            self._wait(lambda: index < len(self._shards))
            if index >= len(self._shards):
                return None
            return Placement(self._shards[index], index in self._duplicates)

    def placed(self) -> tuple[int, int, bool]:
        """Rows and shards of the counted shards placed so far, and whether the plan is made (the
        counts are then final); no waiting."""
        with self._cond:
            return self._counts[0], self._counts[1], self._plan is not None

    def cuts(self, after: int) -> list[ShardCut]:
        """The shards cut so far, from the ``after``-th on (no waiting)."""
        with self._cond:
            if self._error is not None and not isinstance(self._error, PlanStopped):
                raise self._error
            return self._cuts[after:]

    def plan(self) -> ShardPlan:
        """The stored plan, once the thread read the whole dataset."""
        with self._cond:
            self._wait(lambda: False)
            assert self._plan is not None
            return self._plan

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def check_resumed(commit: ShardCommit, cut: ShardCut, dataset: str) -> None:
    """A shard committed before plan.json existed must hold the rows the dataset has now, made with
    this run's settings (pure)."""
    where = f"shard {cut.shard} was committed"
    if commit.source is None:
        raise permanent(
            f"{where} by a process that stored plan.json, which is gone: hsx cannot tell which rows and settings "
            "it holds; restore plan.json or start a new runId"
        )
    if (commit.start, commit.stop) != (cut.start, cut.stop):
        raise permanent(
            f"{where} for samples [{commit.start}, {commit.stop}) but {dataset} now cuts it at "
            f"[{cut.start}, {cut.stop}): the dataset changed since; restore it or start a new runId"
        )
    now = cut.source_json() or {}
    if commit.source.get("plan") != now.get("plan"):
        raise permanent(
            f"{where} with other settings than this run's (model, tokenizer, capture or dataset options: the "
            "plan digests differ); use the original settings or a new runId"
        )
    if (commit.source["lines"], commit.source["digest"]) != (now.get("lines"), now.get("digest")):
        first, last = commit.source["lines"]
        raise permanent(
            f"{where} from lines {first}-{last} of {dataset}, which changed since (digest "
            f"{commit.source['digest']}, now {now.get('digest')}); restore the dataset or start a new runId"
        )


def check_committed(store: Store, committed: set[int], cut: ShardCut, dataset: str) -> None:
    """Before plan.json exists, the planning thread checks each committed shard against its cut, so a
    plan is never stored over a shard committed from other rows or settings."""
    if cut.shard in committed:
        commit = store.get_commit(cut.shard)
        if commit is not None:
            check_resumed(commit, cut, dataset)


def check_none_beyond(committed: set[int], plan: ShardPlan, dataset: str) -> None:
    """A committed shard past the new plan's last one: the dataset lost rows since it was committed."""
    beyond = sorted(k for k in committed if k >= len(plan.shards))
    if beyond:
        raise permanent(
            f"shards {beyond[:5]} were committed, but {dataset} now makes only {len(plan.shards)} shards: "
            "the dataset lost rows since; restore it or start a new runId"
        )
