"""The concurrent part of a run: send samples, collect each one's dump by rid, validate, fill
and seal shards. At most ``concurrency`` requests are at the server and twice that many samples
are between reading and their shard; tokenizing runs in a thread, store I/O in its own threads."""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_extractor.config import ExtractConfig
from hsx_extractor.model import ModelShape
from hsx_extractor.protocol import RunKey, dump_bytes_bound, make_rid
from hsx_extractor.reasons import Reason, is_dataset_reason
from hsx_extractor.run import collect
from hsx_extractor.run.collect import Collector
from hsx_extractor.run.consistency import Consistency, logprob_request
from hsx_extractor.run.dataset import Prepared, Rejected
from hsx_extractor.run.failures import RunFailed, describe_failure, permanent
from hsx_extractor.run.plan import ShardCut
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.server_client import RequestRejected, ServerClient
from hsx_extractor.run.sources import DatasetError
from hsx_extractor.run.validate import (
    REJECTION_EXAMPLES,
    DatasetRejected,
    Mismatch,
    MismatchGate,
    rejection_verdict,
)
from hsx_extractor.storage.backends import StoreError
from hsx_extractor.storage.commit_record import QuarantineEntry, ShardCommit
from hsx_extractor.storage.shard_format import NonFiniteValues, SampleRecord
from hsx_extractor.storage.store import ShardBuilder, Store


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> float:
    """CPUs this process may use: the cgroup's CPU limit (a pod's limits.cpu; cgroup v2 `cpu.max` or v1
    `cpu.cfs_quota_us`) when there is one, else the CPUs it may be scheduled on."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            text = (cgroup / quota_file).read_text().split()
            quota, period = (text[0], text[1]) if period_file is None else (text[0], (cgroup / period_file).read_text())
            if quota not in ("max", "-1"):
                return max(int(quota) / int(period), 1.0)
        except (OSError, ValueError, IndexError):
            continue
    return float(len(os.sched_getaffinity(0)))


def encode_workers(cores: float | None = None) -> int:
    """Threads that encode samples: one per usable core, at most 16 (HSX_ENCODE_THREADS overrides)."""
    wanted = os.environ.get("HSX_ENCODE_THREADS")
    if wanted:
        if not wanted.isdigit() or int(wanted) < 1:
            raise permanent(f"HSX_ENCODE_THREADS must be a positive whole number, got {wanted!r}")
        return int(wanted)
    return max(1, min(16, round(cores if cores is not None else usable_cores())))


# A sender waiting this long for room in the dump directory is reported as stalled.
STALL_REPORT_SECONDS = 30.0


@dataclass(frozen=True)
class EngineContext:
    """What the engine needs of its run; the run owns these and outlives the engine."""

    cfg: ExtractConfig
    progress: Progress
    gate: MismatchGate
    # This process's key (run, replica, process): every rid it sends is made with it; dumps of
    # another process of the same run and replica are a dead earlier process's.
    run_key: RunKey
    # Encodes samples into their shards' spools, several at a time (zstd, numpy, hashing and pwrite
    # release the GIL): one thread capped a pod near 0.4-0.7 GB/s of hidden states (issue 17).
    encode_threads: ThreadPoolExecutor
    seal_threads: ThreadPoolExecutor
    # The consistency check (None: off).
    consistency: Consistency | None = None
    # Counts a shard committed by an earlier process (index, record (None if gone), rows) when the
    # reader meets it while planning.
    resumed: Callable[[int, ShardCommit | None, int], None] | None = None


@dataclass
class ShardState:
    index: int
    start: int
    # One past the shard's last row; None until the plan cuts the shard (a ShardCut arrives).
    stop: int | None = None
    resolved: int = 0  # rows added or quarantined
    builder: ShardBuilder | None = None
    # The rows it was cut from (ShardCut.source_json), for its commit record.
    source: dict[str, Any] | None = None

    @property
    def full(self) -> bool:
        return self.stop is not None and self.resolved == self.stop - self.start


@dataclass(frozen=True)
class ShardRow:
    """A row for the worker and the shard it goes into (the reader knows it when the row is read)."""

    shard: int
    item: Prepared | Rejected


@dataclass(frozen=True)
class ShardResumed:
    """A shard committed by an earlier process, met while the plan is being made."""

    shard: int
    commit: ShardCommit | None  # None: its record could not be read back
    rows: int


# What a reader hands the worker, in dataset order: a shard's cut comes before its rows, or after
# some of them when the plan is still being made.
ReaderEvent = ShardRow | ShardCut | ShardResumed


class ShardWorker:
    """The concurrent part: sends samples, collects their dumps, fills and seals shards."""

    def __init__(
        self,
        ctx: EngineContext,
        store: Store,
        client: ServerClient,
        shape: ModelShape,
        producer: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.producer = producer  # every dump must come from it (the engine the manifest names)
        self.cfg = ctx.cfg
        self.progress = ctx.progress
        self.store = store
        self.client = client
        self.shape = shape
        # Shards met so far (a row or a cut arrived); the reader decides which.
        self.shards: dict[int, ShardState] = {}
        self.collector = Collector(self.cfg.dumpDir, own=ctx.run_key)
        self.commits: list[ShardCommit] = []
        # Dump bytes expected for each request in flight (rid -> bytes), until its dump is gone.
        self._reserved: dict[str, int] = {}
        # Samples between read and shard; twice the requests in flight keeps the server fed.
        self._active = asyncio.Semaphore(2 * self.cfg.concurrency)
        # Shards held on scratch (opened, not yet committed): reading waits at output.maxOpenShards, so
        # a slow store holds the pod's disk at that many shards, not at every shard read meanwhile.
        self._open_shards = asyncio.Semaphore(self.cfg.output.maxOpenShards)
        self._opened: set[int] = set()  # shards that took a place (cuts may come long before rows)
        # When back-pressure began a stall that was reported (None: not stalled).
        self._stalled_since: float | None = None
        # Opening a shard's builder, counting its rows and cutting it, for adds on several threads.
        self._shard_lock = threading.Lock()
        self._rejected_examples: list[QuarantineEntry] = []  # the first dataset rejections, for the gate's message

    async def run(self, reader: Callable[[Callable[[ReaderEvent], None]], None]) -> None:
        # What start-up made (modules, tokenizer: ~375k objects) lives for the whole run: frozen, a full
        # collection no longer walks it (0.1 s each; user time -0.03 core-s/GB, bench/extractor_cost.py).
        # Unfrozen after, so what dies later in cycles is collected in processes that run again (tests).
        gc.collect()
        gc.freeze()
        try:
            await self._run(reader)
        finally:
            gc.unfreeze()

    async def _run(self, reader: Callable[[Callable[[ReaderEvent], None]], None]) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[ReaderEvent | None] = asyncio.Queue(maxsize=4 * self.cfg.concurrency)
        stop = threading.Event()

        def emit(item: ReaderEvent) -> None:
            if stop.is_set():
                raise _ReaderStopped
            asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

        def produce() -> None:
            # Tokenizing is CPU work: it runs in this thread, never in the event loop.
            try:
                reader(emit)
            except _ReaderStopped:
                return
            except StoreError:
                raise  # its own exit code: a transient one (S3 busy, plan.json not stored yet) is retried
            except (OSError, ValueError) as exc:
                raise DatasetError(f"reading the dataset {self.cfg.dataset.uri}: {exc}") from exc
            finally:
                if not stop.is_set():
                    asyncio.run_coroutine_threadsafe(queue.put(None), loop).result()

        reading = loop.run_in_executor(None, produce)
        pending: set[asyncio.Task[None]] = set()
        try:
            async with asyncio.TaskGroup() as group:
                sweeper = group.create_task(self._sweep_forever())
                while (event := await queue.get()) is not None:
                    if isinstance(event, ShardResumed):
                        (self.ctx.resumed or self.progress.shard_resumed)(event.shard, event.commit, event.rows)
                        continue
                    if not isinstance(event, ShardCut) and event.shard not in self._opened:
                        await self._open_shards.acquire()  # a shard's first row: it needs room on scratch
                        self._opened.add(event.shard)
                    if isinstance(event, ShardCut):
                        if not self._cut(event):
                            continue
                        task: asyncio.Task[Any] = group.create_task(self._seal(self.shards[event.shard]))
                    elif isinstance(item := self._arrived(event), Rejected):
                        entry = _quarantine(item.index, item.sample_id, item.reason, item.detail, item.line)
                        task = group.create_task(self._resolve(event.shard, item.index, entry))
                    else:
                        await self._active.acquire()
                        task = group.create_task(self._sample(event.shard, item))
                        task.add_done_callback(lambda _: self._active.release())
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                await reading
                while pending:
                    await asyncio.wait(set(pending))
                sweeper.cancel()
        except* Exception as group_exc:
            # The first error ends the run; failures.describe_failure decides its exit code.
            first = _first(group_exc)
            if isinstance(first, RunFailed):
                raise first from None
            message, code = describe_failure(first)
            raise RunFailed(message, code) from first
        finally:
            stop.set()
            while not queue.empty():  # unblock a reader waiting on a full queue
                queue.get_nowait()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.collector.sweep)

    async def _reserve(self, rid: str, nbytes: int) -> None:
        """Wait until a dump of ``nbytes`` fits under dumpDirMaxBytes, counting this run's dumps on
        disk and the dumps of its requests in flight at their full size before they exist, then
        reserve its room. Other runs' files are not counted: nothing here would ever free them.

        Checking and reserving happen with no await between them, so concurrent senders cannot
        overshoot the limit together. A sample bigger than the limit alone still goes once nothing
        else of ours is in flight (it would wait forever otherwise) and is reported. A wait longer
        than STALL_REPORT_SECONDS is reported (progress lastError and the log), once per stall.
        """
        limit = self.cfg.dumpDirMaxBytes
        waited_since: float | None = None
        while True:
            on_disk = collect.waiting_bytes(self.cfg.dumpDir, exclude_rids=self._reserved, own=self.ctx.run_key)
            reserved = sum(self._reserved.values())
            held = on_disk + reserved
            oversized_alone = nbytes > limit and held == 0
            if held + nbytes <= limit or oversized_alone:
                if oversized_alone:
                    self.progress.last_error = f"back-pressure: one dump of {nbytes} bytes exceeds dumpDirMaxBytes {limit}; sent alone"
                if self._stalled_since is not None:
                    stalled = time.monotonic() - self._stalled_since
                    print(f"hsx: back-pressure: sending again after {stalled:.0f}s stalled", flush=True)
                    self._stalled_since = None
                self._reserved[rid] = nbytes
                return
            now = time.monotonic()
            waited_since = waited_since or now
            if self._stalled_since is None and now - waited_since > STALL_REPORT_SECONDS:
                self._stalled_since = waited_since
                self.progress.last_error = (
                    f"back-pressure stalled for {now - waited_since:.0f}s: this run's dumps in "
                    f"{self.cfg.dumpDir} hold {on_disk} bytes and its {len(self._reserved)} requests in flight "
                    f"reserve {reserved}; one more dump of {nbytes} would pass dumpDirMaxBytes {limit}. "
                    "Other runs' files are not counted. If this lasts, dumps are not being collected: "
                    "check the server's dump directory and the extractor's store"
                )
                print(f"hsx: {self.progress.last_error}", flush=True)
            await asyncio.sleep(0.02)

    def _state(self, shard: int, first_row: int) -> ShardState:
        """The shard's state, made when its cut or its first row (rows come in order) arrives."""
        state = self.shards.get(shard)
        if state is None:
            state = self.shards[shard] = ShardState(shard, first_row)
        return state

    def _arrived(self, row: ShardRow) -> Prepared | Rejected:
        """A row is here: its shard exists from now on."""
        self._state(row.shard, row.item.index)
        return row.item

    def _cut(self, cut: ShardCut) -> bool:
        """The shard's rows are known now; True when every one of them is already resolved."""
        with self._shard_lock:
            state = self._state(cut.shard, cut.start)
            state.stop, state.source = cut.stop, cut.source_json()
            if state.builder is not None:
                state.builder.end_at(cut.stop)
            return state.full

    async def _sample(self, shard: int, sample: Prepared) -> None:
        v = self.cfg.validation
        ids = sample.input_ids.tolist()
        outcome: Mismatch | None = None
        dump_bytes = dump_bytes_bound(len(ids), self.shape.hidden_size, len(self.shape.capture_layers))
        # Every request sent for this sample, HTTP retries included, has its own attempt number.
        numbers = itertools.count()
        for retry in range(v.maxRetries + 1):
            rid = make_rid(self.ctx.run_key, sample.index, next(numbers))
            await self._reserve(rid, dump_bytes)
            sent = [rid]
            try:
                outcome = await self._attempt(shard, sample, ids, sent, numbers, retry)
            finally:
                # Its dump is in the shard, removed, or abandoned (swept when it lands).
                for r in sent:
                    self._reserved.pop(r, None)
            if outcome is None:
                self.gate.record(False)
                return
            if outcome.reason != Reason.NO_DUMP:
                break
        assert outcome is not None
        self.gate.record(True)
        self.progress.last_error = f"sample {sample.index}: {outcome.reason}: {outcome.detail}"
        if v.onMismatch == "fail":
            raise permanent(
                f"validation.onMismatch=fail: sample {sample.index} ({sample.sample_id}): "
                f"{outcome.reason}: {outcome.detail}"
            )
        await self._resolve(
            shard,
            sample.index,
            _quarantine(sample.index, sample.sample_id, outcome.reason, outcome.detail, sample.line),
        )
        verdict = self.gate.verdict()
        if verdict:
            raise permanent(verdict)

    async def _attempt(
        self, shard: int, sample: Prepared, ids: list[int], sent: list[str], numbers: Iterator[int], retry: int
    ) -> Mismatch | None:
        """One request for ``sample`` (first sent as ``sent[0]``): None once its record is in its
        shard, else why not. An HTTP retry goes out under a new rid (appended to ``sent``); the rid
        whose answer was lost is abandoned, so its dump is deleted whenever it lands."""
        v = self.cfg.validation

        def renew(lost: str) -> str:
            rid = make_rid(self.ctx.run_key, sample.index, next(numbers))
            self._reserved[rid] = self._reserved.pop(lost, 0)  # the new rid takes over the room
            self.collector.abandon(lost)
            sent.append(rid)
            return rid

        consistency = self.ctx.consistency
        positions = consistency.plan(sample.index, len(ids)) if consistency else []
        extra = logprob_request(positions, consistency.spec.topK) if consistency and positions else None
        try:
            answered = await self.client.generate(ids, sent[0], renew, extra)
            rid = answered.rid
        except RequestRejected as exc:
            return Mismatch(Reason.SERVER_ERROR, f"rid {exc.rid}: {exc}")
        arrival = await self.collector.wait(rid, v.dumpTimeoutSeconds)
        if arrival is None:
            self.collector.abandon(rid)
            return Mismatch(
                Reason.NO_DUMP, f"no dump for {rid} within {v.dumpTimeoutSeconds:g}s ({retry + 1} attempts)"
            )
        checked = await asyncio.to_thread(
            collect.check_collected,
            arrival,
            rid,
            sample.input_ids,
            self.shape.hidden_size,
            len(self.shape.capture_layers),
            self.shape.capture_layers,
            self.producer,
            self.shape.final_state,
            # A sample checked for consistency has its values checked before its logits are; the others'
            # are counted as they are encoded (one read of the dump, not two).
            bool(consistency and positions),
        )
        if isinstance(checked, Mismatch):
            collect.remove(self.cfg.dumpDir, rid)
            return checked
        if consistency and positions:
            try:
                await consistency.judge(sample.index, checked.hidden_states, positions, answered.body)
            except BaseException:
                collect.remove(self.cfg.dumpDir, rid)
                raise
        record = SampleRecord(
            sample.index,
            sample.sample_id,
            sample.input_ids,
            sample.loss_mask,
            checked.aux_hidden_states,
            checked.hidden_states,
        )
        return await self._resolve(shard, sample.index, record, rid)

    @property
    def gate(self) -> MismatchGate:
        return self.ctx.gate

    async def _resolve(
        self, shard_index: int, index: int, item: SampleRecord | QuarantineEntry, rid: str | None = None
    ) -> Mismatch | None:
        """Hand one row's result to its shard (on an encode thread); seal the shard when it is full. A
        sample whose values are found not finite as they are encoded is not added: its mismatch is returned."""
        loop = asyncio.get_running_loop()
        shard = self.shards[shard_index]
        try:
            full = await loop.run_in_executor(self.ctx.encode_threads, self._add, shard, item, rid)
        except NonFiniteValues as exc:
            return Mismatch(Reason.NON_FINITE, str(exc))
        if isinstance(item, SampleRecord):
            self.progress.sample_done(item.seq_len, shard_index)
        else:
            self.progress.sample_quarantined(item.reason, shard_index)
            if is_dataset_reason(item.reason) and len(self._rejected_examples) < REJECTION_EXAMPLES:
                self._rejected_examples.append(item)
            verdict = rejection_verdict(
                self.progress.quarantined, self.progress.samples_done, self.cfg.validation.maxRejectedRowRate,
                final=False, examples=self._rejected_examples,
            )  # fmt: skip
            if verdict:
                raise DatasetRejected(verdict)
        if full:
            await self._seal(shard)
        return None

    async def _seal(self, shard: ShardState) -> None:
        assert shard.builder is not None and shard.stop is not None
        rows = range(shard.start, shard.stop)
        checks = self.ctx.consistency.shard_summary(rows) if self.ctx.consistency else None
        seal = functools.partial(shard.builder.seal, checks, shard.source)
        began = time.monotonic()
        commit = await asyncio.get_running_loop().run_in_executor(self.ctx.seal_threads, seal)
        self._open_shards.release()
        self.commits.append(commit)
        self.progress.shard_committed(commit.shard_index, commit.bytes_stored, time.monotonic() - began)

    def _add(self, shard: ShardState, item: SampleRecord | QuarantineEntry, rid: str | None) -> bool:
        """Add to the shard (the builder is safe for concurrent adds); True for the shard's last row."""
        with self._shard_lock:
            if shard.builder is None:
                if shard.stop is None:
                    shard.builder = self.store.open_shard_at(shard.index, shard.start)
                else:
                    shard.builder = self.store.open_shard(shard.index, range(shard.start, shard.stop))
            builder = shard.builder
        try:
            if isinstance(item, SampleRecord):
                builder.add(item)
            else:
                builder.quarantine(item)
        finally:
            if rid is not None:
                collect.remove(self.cfg.dumpDir, rid)  # in the shard's spool now, or refused; free the shm
        with self._shard_lock:
            shard.resolved += 1
            return shard.full

    def unfinished(self) -> list[int]:
        """Shards met but not complete when the reader ended."""
        return sorted(k for k, s in self.shards.items() if not s.full)

    def abort_open(self) -> None:
        for shard in list(self.shards.values()):
            if shard.builder is not None and shard.builder.result is None:
                shard.builder.abort()


class _ReaderStopped(Exception):
    """Tells the reader thread that the run ended without it."""


def _quarantine(
    index: int, sample_id: str | None, reason: str, detail: str, line: int | None = None
) -> QuarantineEntry:
    return QuarantineEntry(index, sample_id, str(reason), detail, line)


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    exc = group.exceptions[0]
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
