"""One extraction run: dataset -> tokens -> server -> dumps by rid -> validated samples -> shards.

Resume needs no local state: shards with a commit record are skipped, every other shard is leased
(run/leases.py) and redone from its first row, and a shard becomes visible only through its commit
record, so a crash at any point (SIGKILL included) leaves each good sample in the output exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp

from hsx_extractor import protocol
from hsx_extractor.config import ExtractConfig
from hsx_extractor.model import (
    LAYER_CONVENTION,
    ModelConfigError,
    ModelShape,
    check_vocab,
    model_fingerprint,
    model_identity,
    model_shape,
)
from hsx_extractor.protocol import RunKey
from hsx_extractor.run import collect
from hsx_extractor.run.consistency import (
    CaptureInconsistent,
    Checker,
    Consistency,
    ConsistencyGate,
    FinalState,
    SamplePicks,
)
from hsx_extractor.run.dataset import Prepared, Rejected, dataset_endpoint, dataset_rows
from hsx_extractor.run.engine import EngineContext, ShardWorker, encode_workers
from hsx_extractor.run.failures import permanent
from hsx_extractor.run.leases import Leases
from hsx_extractor.run.lm_head import LmHead
from hsx_extractor.run.plan import (
    PLAN_NAME,
    PlanMismatch,
    Planner,
    ShardCut,
    ShardPlan,
    hashed,
)
from hsx_extractor.run.planning import PlanAhead, ReadFraction, check_committed, check_none_beyond
from hsx_extractor.run.producers import ENGINE_PRODUCERS, engine_of
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.readers import Reader, planned_reader, planning_reader
from hsx_extractor.run.regenerate import Regenerator, generations_stored, row_samples
from hsx_extractor.run.server_client import ServerClient
from hsx_extractor.run.tokens import ChatTokenizer, TokenizerError
from hsx_extractor.run.validate import DatasetRejected, MismatchGate, rejection_verdict
from hsx_extractor.storage import failpoints, native
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.manifest import Capture
from hsx_extractor.storage.shard_format import STATES_DTYPE
from hsx_extractor.storage.store import Store, open_store
from hsx_extractor.storage.uris import dataset_digest, uri_stat


def replica_from_env(cfg: ExtractConfig) -> ExtractConfig:
    """An indexed Job sets JOB_COMPLETION_INDEX; it is the replica index unless the config sets one."""
    env = os.environ.get("JOB_COMPLETION_INDEX")
    if env is not None and "replicaIndex" not in cfg.model_fields_set:
        return cfg.model_copy(update={"replicaIndex": int(env)})
    return cfg


@dataclass
class RunResult:
    """What a finished run did (this process only, plus the manifest if it wrote the last shard)."""

    run_id: str
    output: str
    fingerprint: str
    shards_done: list[int]
    commits: list[ShardCommit] = field(default_factory=list)
    manifest: dict[str, Any] | None = None


class Extraction:
    def __init__(self, cfg: ExtractConfig, progress: Progress | None = None) -> None:
        self.cfg = replica_from_env(cfg)
        self.progress = progress or Progress(self.cfg.runId, self.cfg.replicaIndex)
        v = cfg.validation
        self.gate = MismatchGate(v.maxMismatchRate, v.gateWindow, v.gateMinSamples)
        # A fresh key per process: a restarted extractor never reuses a rid the server has seen.
        self.run_key = RunKey(cfg.runId, self.cfg.replicaIndex, os.urandom(3).hex(), cfg.workerIndex or 0)
        self.encode_threads = ThreadPoolExecutor(max_workers=encode_workers(), thread_name_prefix="hsx-encode")
        self.seal_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hsx-seal")
        c = self.cfg.validation.consistency
        self.consistency_gate = ConsistencyGate(c.maxFailureRate, c.minChecks)
        self.progress.watch_consistency(lambda: (self.consistency_gate.checked, self.consistency_gate.failed))
        # Why the consistency check is off, when it is (the manifest says so).
        self.consistency_off: str | None = None
        self.regenerator: Regenerator | None = None  # responses: regenerate

    # ---- start: tokenizer, server, store, plan ----------------------------------------------
    def open_tokenizer(self) -> ChatTokenizer:
        cfg = self.cfg
        tokenizer_dir = cfg.dataset.tokenizer or cfg.modelPath
        if not tokenizer_dir:
            raise permanent("set modelPath or dataset.tokenizer: hsx tokenizes with the model's tokenizer")
        try:
            tok = ChatTokenizer(tokenizer_dir, cfg.dataset.chatTemplate, cfg.dataset.specialTokensInContent)
            if cfg.dataset.format == "messages" and not tok.chat_template:
                raise TokenizerError(f"{tokenizer_dir} has no chat template; set dataset.chatTemplate")
        except TokenizerError as exc:
            raise permanent(str(exc)) from exc
        expected = cfg.dataset.expectedTokenizerFingerprint
        if expected and tok.fingerprint != expected:
            raise permanent(
                f"tokenizer fingerprint mismatch: the dataset was prepared with {expected}, "
                f"the tokenizer in {tokenizer_dir} is {tok.fingerprint}"
            )
        return tok

    def plan_identity(self, tok: ChatTokenizer, shape: ModelShape) -> dict[str, Any]:
        d = self.cfg.dataset
        return {
            "dataset": d.uri,
            "format": d.format,
            "limit": d.limit,
            "maxLength": d.maxLength,
            "expandTurns": d.expandTurns,
            "specialTokensInContent": d.specialTokensInContent,
            "tokenizerFingerprint": tok.fingerprint,
            "shardTargetBytes": self.cfg.output.shardTargetBytes,
            "hiddenSize": shape.hidden_size,
            "captureLayers": list(shape.capture_layers),
            "model": model_fingerprint(self.cfg.modelPath),
            **({"regenerate": self.cfg.generation.model_dump()} if self.cfg.responses == "regenerate" else {}),
            # Only when not the default, so plans written before the key existed still resume.
            **({"finalState": shape.final_state} if shape.final_state != protocol.FINAL_POST_NORM else {}),
        }

    def check_dataset_unchanged(self, plan: ShardPlan) -> None:
        """Refuse to resume over a dataset that changed since the plan (cheap when its stat is the same)."""
        d = self.cfg.dataset
        where = dataset_endpoint(self.cfg)
        if not plan.digests or uri_stat(d.uri, where) == plan.source:
            return
        digests: dict[int, int] = {}
        for row in hashed(dataset_rows(self.cfg), digests):
            if row.line >= plan.last_line:
                break
        changes = plan.changed_shards(digests)
        if changes:
            shown = "; ".join(changes[:10]) + (f"; and {len(changes) - 10} more" if len(changes) > 10 else "")
            raise permanent(
                f"dataset {d.uri} changed since this run was planned: {shown}. Resuming would mix old and "
                "new rows; restore the dataset or start a new runId"
            )

    async def load_plan(self, store: Store, tok: ChatTokenizer, shape: ModelShape) -> ShardPlan | None:
        """The stored plan, checked against this run's settings and dataset; None when no process
        stored one yet: this one then makes it while extracting (:meth:`_planning_reader`)."""
        stored = await asyncio.to_thread(store.get_json, PLAN_NAME)
        if stored is None:
            return None
        plan = self._checked_plan(store, stored, self.plan_identity(tok, shape))
        await asyncio.to_thread(self.check_dataset_unchanged, plan)
        return plan

    def _checked_plan(self, store: Store, stored: dict[str, Any], identity: dict[str, Any]) -> ShardPlan:
        try:
            plan = ShardPlan.from_json(stored)
            plan.check_identity(identity)
        except (PlanMismatch, KeyError, TypeError, ValueError) as exc:
            raise permanent(f"{store.description}/{PLAN_NAME}: {exc}") from exc
        return plan

    def store_plan(self, store: Store, plan: ShardPlan) -> ShardPlan:
        """Store the plan made while extracting (write-if-absent); one another process stored first
        must cut the same shards from the same rows."""
        stored = store.put_json_if_absent(PLAN_NAME, plan.to_json())
        failpoints.reach("plan-written")
        kept = self._checked_plan(store, stored, plan.identity)
        if (kept.shards, kept.duplicates, kept.digests) != (plan.shards, plan.duplicates, plan.digests):
            raise permanent(
                f"{store.description}/{PLAN_NAME} was stored by another process and cuts other shards than this "
                f"process read from {self.cfg.dataset.uri} ({len(kept.shards)} vs {len(plan.shards)} shards): the "
                "dataset changed while the run was being planned; restore it or start a new runId"
            )
        return kept

    def open_head(self, shape: ModelShape) -> LmHead | None:
        """The model's head for the consistency check; None (and why, in consistency_off) when the
        check is off. Left at its default, a model directory without readable weights turns the check
        off with a warning; asked for explicitly, it fails the run."""
        spec = self.cfg.validation.consistency
        if spec.samples_per_shard == 0:
            self.consistency_off = "validation.consistency.samplesPerShard is 0"
            return None
        if self.cfg.engine != "sglang":  # it asks SGLang's logprob fields; vLLM's prompt_logprobs differ
            if spec.asked:
                raise permanent(f"validation.consistency is not supported with engine {self.cfg.engine} yet")
            self.consistency_off = f"not supported with engine {self.cfg.engine} yet"
            return None
        try:
            if not self.cfg.modelPath:
                raise ModelConfigError("no modelPath: the extractor needs the model's weights for the check")
            head = LmHead(self.cfg.modelPath)
        except (ModelConfigError, OSError, ValueError) as exc:
            if spec.asked:
                raise permanent(f"validation.consistency: {exc}") from exc
            self.consistency_off = f"cannot read the model's head: {exc}"
            print(f"hsx: warning: consistency check off: {self.consistency_off}", flush=True)
            return None
        if head.hidden_size != shape.hidden_size:
            raise permanent(
                f"the model's head takes hidden size {head.hidden_size}, the server captures {shape.hidden_size}"
            )
        return head

    def consistency_for(self, shape: ModelShape) -> Consistency | None:
        """The check, with no sample picked yet: the readers pick as rows arrive (SamplePicks)."""
        head = self.open_head(shape)
        if head is None:
            return None
        spec = self.cfg.validation.consistency
        picks = SamplePicks(spec.samples_per_shard)
        return Consistency(Checker(head, spec, cast(FinalState, shape.final_state)), self.consistency_gate, picks)

    # ---- the run -------------------------------------------------------------------------------
    async def run(self) -> RunResult:
        cfg = self.cfg
        try:
            kernels = native.kernels()
        except native.NativeLibraryError as exc:
            raise permanent(str(exc)) from exc
        print(f"hsx: bf16 kernels: {native.describe(kernels)}", flush=True)
        tok = await asyncio.to_thread(self.open_tokenizer)
        try:
            store = await asyncio.to_thread(open_store, cfg.output, cfg.runId)
        except ValueError as exc:
            raise permanent(f"output {cfg.output.uri}: {exc}") from exc
        try:
            return await self._run_with(store, tok)
        finally:
            store.close()

    async def _run_with(self, store: Store, tok: ChatTokenizer) -> RunResult:
        cfg = self.cfg
        protocol.make_dump_dir(cfg.dumpDir)
        stale = collect.Collector(cfg.dumpDir, own=self.run_key).sweep()
        if stale:
            print(f"hsx: removed {stale} dumps left by dead processes or runs in {cfg.dumpDir}", flush=True)
        connector = aiohttp.TCPConnector(limit=cfg.concurrency + 4)
        async with aiohttp.ClientSession(connector=connector) as session:
            client = ServerClient(cfg.serverUrl, session, cfg.concurrency, engine=cfg.engine)
            self.progress.watch_in_flight(lambda: client.in_flight)
            await client.wait_healthy(cfg.serverStartTimeoutSeconds, self.progress.waiting)
            info = await client.model_info()
            shape = model_shape(info, cfg.modelPath, cfg.auxLayerIds, cfg.engine, cfg.finalState)
            check_vocab(shape, tok.vocab_size, cfg.modelPath)
            # SGLang's /get_model_info and vLLM name no producer; the reference server names itself.
            producer = str(info.get("producer") or ENGINE_PRODUCERS[cfg.engine])
            engine = engine_of(producer)
            plan = await self.load_plan(store, tok, shape)
            committed = await asyncio.to_thread(store.committed_shards)
            consistency = self.consistency_for(shape)
            leases = await asyncio.to_thread(self.open_leases, store, asyncio.get_running_loop())
            rest = (producer, consistency, leases)
            if cfg.responses == "regenerate":
                self.regenerator = Regenerator(cfg, tok, store, client, self.progress, asyncio.get_running_loop(),
                                               leases.stop)  # fmt: skip
            try:
                if plan is None:
                    plan, commits = await self._extract_planning(store, client, tok, shape, committed, *rest)
                else:
                    commits = await self._extract_planned(store, client, tok, shape, plan, committed, *rest)
            except BaseException:
                await asyncio.to_thread(leases.stop, True)  # others take this process's shards at once
                raise
            leases.stop()
            for c in await asyncio.to_thread(self._others_committed, store, leases):  # the last ones
                self._resumed(c.shard_index, c, c.stop - c.start)
        verdict = self.consistency_gate.verdict(final=True)
        if verdict:
            raise CaptureInconsistent(verdict)
        examples = [q for c in sorted(commits, key=lambda c: c.shard_index) for q in c.quarantine]
        p, rate = self.progress, cfg.validation.maxRejectedRowRate
        if rejected := rejection_verdict(p.quarantined, p.samples_done, rate, final=True, examples=examples):
            raise DatasetRejected(rejected)  # nothing that is mostly rejections ends Succeeded
        described = functools.partial(self.describe, tok, shape, plan, engine)
        manifest = await asyncio.to_thread(store.finalize, plan.planned(), described)
        if manifest is not None:
            await asyncio.to_thread(leases.clear)
        self.progress.mark_succeeded()
        done = sorted(c.shard_index for c in commits)
        return RunResult(cfg.runId, store.description, tok.fingerprint, done, commits, manifest)

    def open_leases(self, store: Store, loop: asyncio.AbstractEventLoop) -> Leases:
        """This process's leases, renewed from now on; renewals count others' commits (progress is the run's)."""
        leases = Leases(store, self.run_key.slot, self.run_key.process, self.cfg.leaseSeconds)
        leases.probe()
        if self.cfg.responses == "regenerate":
            leases.raceable = generations_stored(store)

        def count_others() -> None:
            for c in self._others_committed(store, leases):
                loop.call_soon_threadsafe(self._resumed, c.shard_index, c, c.stop - c.start)

        leases.on_tick = count_others
        self.progress.on_commit = leases.wake  # an idle process finishes as soon as its last shard is in
        self.progress.watch_leases(lambda: len(leases.held))
        leases.start()
        return leases

    def _others_committed(self, store: Store, leases: Leases) -> list[ShardCommit]:
        """Commits of shards this process neither counted nor worked on (its engine counts those)."""
        seen = self.progress.counted_shards | leases.worked
        commits = (store.get_commit(k) for k in sorted(store.committed_shards() - seen))
        return [c for c in commits if c is not None]

    def _resumed(self, shard: int, commit: ShardCommit | None, rows: int) -> None:
        """A shard committed by an earlier process or another replica: its rows count as done, and its
        consistency checks count in the run's gate (once)."""
        if shard in self.progress.counted_shards:
            return
        self.progress.shard_resumed(shard, commit, rows)
        if commit is not None and commit.consistency is not None:
            self.consistency_gate.add(len(commit.consistency["checked"]), len(commit.consistency["failed"]))

    def describe(
        self, tok: ChatTokenizer, shape: ModelShape, plan: ShardPlan, engine: tuple[str, str]
    ) -> dict[str, Any]:
        """The manifest's sections that say what the data is; each fact from its owner."""
        cfg = self.cfg
        capture = Capture(
            engine=engine[0],
            engine_version=engine[1],
            layer_ids=shape.capture_layers,
            layer_convention=LAYER_CONVENTION,
            final_state=shape.final_state,
            dtype=STATES_DTYPE,
        )
        return {
            "run": {
                "model": shape.model_path,
                **model_identity(cfg.modelPath),  # modelFingerprint, finalNormDigest
                "architecture": shape.architecture,
                "hiddenSize": shape.hidden_size,
                "vocabSize": shape.vocab_size,
                "auxLayerIds": cfg.auxLayerIds,  # as the spec asked; capture.layerIds is what was captured
                "rows": plan.rows,
                "maxLength": cfg.dataset.maxLength,
                "expandTurns": cfg.dataset.expandTurns,
                "replicaCount": cfg.replicaCount,
                "responses": {"from": cfg.responses, **({"generation": cfg.generation.model_dump()} if self.regenerator else {})},
                "consistency": self.consistency_info(),
            },
            "capture": capture.to_json(),
            "tokenizer": tok.description(),
            "dataset": {**dataset_digest(cfg.dataset.uri, dataset_endpoint(cfg)), "rowsDigest": plan.rows_digest},
        }

    def consistency_info(self) -> dict[str, Any]:
        spec = self.cfg.validation.consistency
        if self.consistency_off:
            return {"off": self.consistency_off}
        return spec.model_dump()  # the final state it assumed is the manifest's capture.finalState

    async def _extract_planned(
        self,
        store: Store,
        client: ServerClient,
        tok: ChatTokenizer,
        shape: ModelShape,
        plan: ShardPlan,
        committed: set[int],
        producer: str,
        consistency: Consistency | None,
        leases: Leases,
    ) -> list[ShardCommit]:
        """Extract the uncommitted shards of a stored plan this process leases."""
        self.progress.shards_total, self.progress.samples_total = len(plan.shards), plan.rows
        for k in sorted(committed):
            self._resumed(k, await asyncio.to_thread(store.get_commit, k), len(plan.shard_range(k)))
        self.progress.mark_running()
        if all(k in committed for k in range(len(plan.shards))):
            return []
        reader = planned_reader(self.cfg, tok, plan, committed, consistency, leases)
        worker = await self._extract(store, client, shape, producer, consistency, reader)
        unfinished = worker.unfinished()
        if unfinished:
            raise permanent(
                f"the dataset ended before shards {unfinished[:5]} were complete: it has fewer rows than "
                f"plan.json ({plan.rows}); was it changed since the plan was made?"
            )
        return worker.commits

    async def _extract_planning(
        self,
        store: Store,
        client: ServerClient,
        tok: ChatTokenizer,
        shape: ModelShape,
        committed: set[int],
        producer: str,
        consistency: Consistency | None,
        leases: Leases,
    ) -> tuple[ShardPlan, list[ShardCommit]]:
        """No plan is stored yet: a thread makes and stores it (run.planning) while extraction starts
        on each row as soon as that thread has placed it in a shard."""
        d = self.cfg.dataset
        where = dataset_endpoint(self.cfg)
        digests: dict[int, int] = {}
        planner = Planner(
            self.plan_identity(tok, shape),
            len(shape.capture_layers),
            shape.hidden_size,
            self.cfg.output.shardTargetBytes,
            digests,
        )

        read = ReadFraction(d.uri, lambda: uri_stat(d.uri, where).get("size"))

        def items() -> Iterator[Prepared | Rejected]:
            return row_samples(self.cfg, hashed(read.count(dataset_rows(self.cfg)), digests), tok)

        def check_cut(cut: ShardCut) -> None:
            check_committed(store, committed, cut, d.uri)

        def finish(planner: Planner, last_line: int) -> ShardPlan:
            if planner.rows == 0:
                raise permanent(f"dataset {d.uri} has no rows")
            last, plan = planner.finish(last_line, uri_stat(d.uri, where))
            if last is not None:
                check_cut(last)
            check_none_beyond(committed, plan, d.uri)
            kept = self.store_plan(store, plan)
            now = self.progress.report()
            print(f"hsx: plan stored: {len(kept.shards)} shards of {kept.rows} samples, the dataset read in "
                  f"{time.monotonic() - started:.1f}s; meanwhile {now.samplesDone} samples were done and "
                  f"{now.requestsInFlight} are at the server", flush=True)  # fmt: skip
            return kept

        ahead = PlanAhead(items, planner, finish, check_cut)
        started = time.monotonic()
        self.progress.watch_planning(ahead.placed, read.fraction)
        self.progress.mark_running()
        ahead.start()
        try:
            reader = planning_reader(self.cfg, store, tok, ahead, committed, consistency, leases)
            worker = await self._extract(store, client, shape, producer, consistency, reader)
            plan = await asyncio.to_thread(ahead.plan)
            samples, shards, _ = ahead.placed()
            self.progress.plan_known(samples, shards)
        finally:
            ahead.stop()
        unfinished = worker.unfinished()
        if unfinished:
            raise permanent(
                f"shards {unfinished[:5]} got fewer rows than the plan gives them: {d.uri} changed while it "
                "was read; restore it or start a new runId"
            )
        return plan, worker.commits

    async def _extract(
        self,
        store: Store,
        client: ServerClient,
        shape: ModelShape,
        producer: str,
        consistency: Consistency | None,
        reader: Reader,
    ) -> ShardWorker:
        ctx = EngineContext(self.cfg, self.progress, self.gate, self.run_key, self.encode_threads, self.seal_threads,
                            consistency, self._resumed)  # fmt: skip
        worker = ShardWorker(ctx, store, client, shape, producer)
        if self.regenerator is not None:  # each shard's generations are stored before its capture
            reader = self.regenerator.reader(reader)
        try:
            await worker.run(reader)
        except BaseException:
            await asyncio.to_thread(worker.abort_open)
            raise
        finally:
            self.encode_threads.shutdown(wait=False)
            self.seal_threads.shutdown(wait=False)
            if consistency is not None:
                g = self.consistency_gate
                print(
                    f"hsx: consistency: {g.checked} checked, {g.failed} disagreed, {consistency.skipped} skipped; "
                    f"{consistency.checker.passes} passes over the head in {consistency.checker.seconds:.2f}s",
                    flush=True,
                )
        return worker
