"""One extraction run: dataset -> tokens -> server -> dumps by rid -> validated samples -> shards.

Resume needs no local state: shards with a commit record are skipped, every other shard of this
replica is redone from its first row, and a shard becomes visible only through its commit record,
so a crash at any point (SIGKILL included) leaves each good sample in the output exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp

from hsx_extractor import __version__, protocol
from hsx_extractor.config import ExtractConfig
from hsx_extractor.model import (
    LAYER_CONVENTION,
    ModelConfigError,
    ModelShape,
    check_vocab,
    model_fingerprint,
    model_shape,
)
from hsx_extractor.protocol import RunKey
from hsx_extractor.reasons import Reason
from hsx_extractor.run import collect
from hsx_extractor.run.consistency import (
    CaptureInconsistent,
    Checker,
    Consistency,
    ConsistencyGate,
    FinalState,
    sampled_indices,
)
from hsx_extractor.run.dataset import Prepared, Rejected, dataset_endpoint, read_samples
from hsx_extractor.run.engine import EngineContext, ShardState, ShardWorker
from hsx_extractor.run.failures import permanent
from hsx_extractor.run.lm_head import LmHead
from hsx_extractor.run.plan import PLAN_NAME, PlanMismatch, ShardPlan, build_plan, hashed, replica_shards
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.server_client import ServerClient
from hsx_extractor.run.sources import iter_rows
from hsx_extractor.run.tokens import ChatTokenizer, TokenizerError
from hsx_extractor.run.validate import MismatchGate
from hsx_extractor.sglang_hook.launch import HOOK_PRODUCER, SGLANG_VERSION
from hsx_extractor.storage import failpoints
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.manifest import Capture
from hsx_extractor.storage.shard_format import STATES_DTYPE
from hsx_extractor.storage.store import Store, open_store
from hsx_extractor.storage.uris import open_uri_chunks, uri_stat
from hsx_extractor.vllm_hook.launch import PRODUCER as VLLM_PRODUCER
from hsx_extractor.vllm_hook.launch import VLLM_VERSION

SERVER_START_TIMEOUT_S = 600.0
# The producer each engine's dumps name (spec.server.engine -> hook/connector).
ENGINE_PRODUCERS = {"sglang": HOOK_PRODUCER, "vllm": VLLM_PRODUCER}


def engine_of(producer: str) -> tuple[str, str]:
    """(engine, version) of a dump producer: SGLang with hsx's hook, or a producer shipped with hsx
    (the reference server), which has hsx's version."""
    if producer == HOOK_PRODUCER:
        return "sglang", SGLANG_VERSION
    if producer == VLLM_PRODUCER:
        return "vllm", VLLM_VERSION
    if producer.startswith("hsx-"):
        return producer, __version__
    raise permanent(f"the server's dumps come from {producer!r}, an engine hsx does not know")


def dataset_digest(uri: str, where: Any) -> dict[str, Any]:
    """sha256 and size of the dataset's bytes, read front to back as stored (compressed files too)."""
    digest, size = hashlib.sha256(), 0
    for chunk in open_uri_chunks(uri, where):
        digest.update(chunk)
        size += len(chunk)
    return {"uri": uri, "digest": f"sha256:{digest.hexdigest()}", "bytes": size}


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


class Extraction:
    def __init__(self, cfg: ExtractConfig, progress: Progress | None = None) -> None:
        self.cfg = replica_from_env(cfg)
        self.progress = progress or Progress(self.cfg.runId, self.cfg.replicaIndex)
        self.gate = MismatchGate(
            cfg.validation.maxMismatchRate, cfg.validation.gateWindow, cfg.validation.gateMinSamples
        )
        # A fresh key per process: a restarted extractor never reuses a rid the server has seen.
        self.run_key = RunKey(cfg.runId, self.cfg.replicaIndex, os.urandom(3).hex())
        self.encode_threads = ThreadPoolExecutor(max_workers=encode_workers(), thread_name_prefix="hsx-encode")
        self.seal_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hsx-seal")
        c = self.cfg.validation.consistency
        self.consistency_gate = ConsistencyGate(c.maxFailureRate, c.minChecks)
        self.progress.watch_consistency(lambda: (self.consistency_gate.checked, self.consistency_gate.failed))
        # Why the consistency check is off, when it is (the manifest says so).
        self.consistency_off: str | None = None

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
            # Only when not the default, so plans written before the key existed still resume.
            **({"finalState": shape.final_state} if shape.final_state != protocol.FINAL_POST_NORM else {}),
        }

    def compute_plan(self, tok: ChatTokenizer, shape: ModelShape) -> ShardPlan:
        """Pre-pass over the whole dataset: lengths, ids and row digests only, nothing else is kept."""
        d = self.cfg.dataset
        where = dataset_endpoint(self.cfg)
        lengths: list[int | None] = []
        ids: list[str | None] = []
        sample_lines: list[int] = []
        digests: dict[int, int] = {}
        rows = hashed(iter_rows(d.uri, where), digests)
        for item in read_samples(rows, tok, d.maxLength, d.format, d.limit, d.expandTurns):
            sample_lines.append(item.line or 0)
            accepted = isinstance(item, Prepared)
            lengths.append(item.length if isinstance(item, Prepared) else None)
            ids.append(item.sample_id if accepted else None)
        if not lengths:
            raise permanent(f"dataset {d.uri} has no rows")
        source = uri_stat(d.uri, where)  # read through: it exists
        return build_plan(
            self.plan_identity(tok, shape),
            lengths,
            ids,
            len(shape.capture_layers),
            shape.hidden_size,
            self.cfg.output.shardTargetBytes,
            sample_lines,
            digests,
            source,
        )

    def check_dataset_unchanged(self, plan: ShardPlan) -> None:
        """Refuse to resume over a dataset that changed since the plan (cheap when its stat is the same)."""
        d = self.cfg.dataset
        where = dataset_endpoint(self.cfg)
        if not plan.digests or uri_stat(d.uri, where) == plan.source:
            return
        digests: dict[int, int] = {}
        for row in hashed(iter_rows(d.uri, where), digests):
            if row.line >= plan.last_line:
                break
        changes = plan.changed_shards(digests)
        if changes:
            shown = "; ".join(changes[:10]) + (f"; and {len(changes) - 10} more" if len(changes) > 10 else "")
            raise permanent(
                f"dataset {d.uri} changed since this run was planned: {shown}. Resuming would mix old and "
                "new rows; restore the dataset or start a new runId"
            )

    async def load_plan(self, store: Store, tok: ChatTokenizer, shape: ModelShape) -> ShardPlan:
        identity = self.plan_identity(tok, shape)
        stored = await asyncio.to_thread(store.get_json, PLAN_NAME)
        if stored is None:
            plan = await asyncio.to_thread(self.compute_plan, tok, shape)
            stored = await asyncio.to_thread(store.put_json_if_absent, PLAN_NAME, plan.to_json())
            failpoints.reach("plan-written")
        try:
            plan = ShardPlan.from_json(stored)
            plan.check_identity(identity)
        except (PlanMismatch, KeyError, TypeError, ValueError) as exc:
            raise permanent(f"{store.description}/{PLAN_NAME}: {exc}") from exc
        await asyncio.to_thread(self.check_dataset_unchanged, plan)
        return plan

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

    def consistency_for(self, shape: ModelShape, plan: ShardPlan, todo: list[int]) -> Consistency | None:
        head = self.open_head(shape)
        if head is None:
            return None
        spec = self.cfg.validation.consistency
        sampled = {
            i
            for k in todo
            for i in sampled_indices(k, plan.shard_range(k), spec.samples_per_shard, self.cfg.runId)
        }
        return Consistency(
            Checker(head, spec, cast(FinalState, shape.final_state)), self.consistency_gate, sampled
        )

    # ---- the run -------------------------------------------------------------------------------
    async def run(self) -> RunResult:
        cfg = self.cfg
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
            await client.wait_healthy(SERVER_START_TIMEOUT_S)
            info = await client.model_info()
            shape = model_shape(info, cfg.modelPath, cfg.auxLayerIds, cfg.engine)
            check_vocab(shape, tok.vocab_size, cfg.modelPath)
            # SGLang's /get_model_info and vLLM name no producer; the reference server names itself.
            producer = str(info.get("producer") or ENGINE_PRODUCERS[cfg.engine])
            engine = engine_of(producer)
            plan = await self.load_plan(store, tok, shape)
            mine = replica_shards(len(plan.shards), cfg.replicaIndex, cfg.replicaCount)
            committed = await asyncio.to_thread(store.committed_shards)
            todo = [k for k in mine if k not in committed]
            await self._count_resumed(store, plan, [k for k in mine if k in committed], len(mine))
            self.progress.mark_running()
            commits = await self._extract(store, client, tok, shape, plan, todo, producer) if todo else []
        verdict = self.consistency_gate.verdict(final=True)
        if verdict:
            raise CaptureInconsistent(verdict)
        described = functools.partial(self.describe, tok, shape, plan, engine)
        manifest = await asyncio.to_thread(store.finalize, plan.planned(), described)
        self.progress.mark_succeeded()
        return RunResult(cfg.runId, store.description, tok.fingerprint, todo, commits, manifest)

    async def _count_resumed(self, store: Store, plan: ShardPlan, done: list[int], mine: int) -> None:
        p = self.progress
        p.shards_total = mine
        p.samples_total = sum(
            len(plan.shard_range(k))
            for k in replica_shards(len(plan.shards), self.cfg.replicaIndex, self.cfg.replicaCount)
        )
        for k in done:
            commit = await asyncio.to_thread(store.get_commit, k)
            n = len(plan.shard_range(k))
            p.samples_done += n
            p.samples_resumed += n
            p.shards_committed += 1
            if commit is not None:
                p.bytes_committed += commit.bytes_stored
                p.samples_written += commit.samples
                for q in commit.quarantine:
                    p.quarantined[q.reason] += 1
                if commit.consistency is not None:  # an earlier process's checks count too
                    self.consistency_gate.add(
                        len(commit.consistency["checked"]), len(commit.consistency["failed"])
                    )

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
                "architecture": shape.architecture,
                "hiddenSize": shape.hidden_size,
                "vocabSize": shape.vocab_size,
                "auxLayerIds": cfg.auxLayerIds,  # as the spec asked; capture.layerIds is what was captured
                "rows": plan.rows,
                "maxLength": cfg.dataset.maxLength,
                "expandTurns": cfg.dataset.expandTurns,
                "replicaCount": cfg.replicaCount,
                "consistency": self.consistency_info(),
            },
            "capture": capture.to_json(),
            "tokenizer": tok.description(),
            "dataset": dataset_digest(cfg.dataset.uri, dataset_endpoint(cfg)),
        }

    def consistency_info(self) -> dict[str, Any]:
        spec = self.cfg.validation.consistency
        if self.consistency_off:
            return {"off": self.consistency_off}
        return spec.model_dump()  # the final state it assumed is the manifest's capture.finalState

    async def _extract(
        self,
        store: Store,
        client: ServerClient,
        tok: ChatTokenizer,
        shape: ModelShape,
        plan: ShardPlan,
        todo: list[int],
        producer: str,
    ) -> list[ShardCommit]:
        shards = {k: ShardState(k, plan.shard_range(k), len(plan.shard_range(k))) for k in todo}
        shard_of = {i: k for k in todo for i in plan.shard_range(k)}
        ctx = EngineContext(
            self.cfg,
            self.progress,
            self.gate,
            self.run_key,
            self.encode_threads,
            self.seal_threads,
            self.consistency_for(shape, plan, todo),
        )
        worker = ShardWorker(ctx, store, client, shape, shards, shard_of, producer)
        try:
            await worker.run(self._reader(tok, plan, shard_of))
        except BaseException:
            await asyncio.to_thread(worker.abort_open)
            raise
        finally:
            self.encode_threads.shutdown(wait=False)
            self.seal_threads.shutdown(wait=False)
            if ctx.consistency is not None:
                c, g = ctx.consistency, self.consistency_gate
                print(
                    f"hsx: consistency: {g.checked} checked, {g.failed} disagreed, {c.skipped} skipped; "
                    f"{c.checker.passes} passes over the head in {c.checker.seconds:.2f}s",
                    flush=True,
                )
        unfinished = sorted(k for k, s in shards.items() if s.remaining)
        if unfinished:
            raise permanent(
                f"the dataset ended before shards {unfinished[:5]} were complete: it has fewer rows than "
                f"plan.json ({plan.rows}); was it changed since the plan was made?"
            )
        return worker.commits

    def _reader(
        self, tok: ChatTokenizer, plan: ShardPlan, shard_of: dict[int, int]
    ) -> Callable[[Callable[[Prepared | Rejected], None]], None]:
        d = self.cfg.dataset

        def read(emit: Callable[[Prepared | Rejected], None]) -> None:
            rows = iter_rows(d.uri, dataset_endpoint(self.cfg))
            wanted = shard_of.__contains__
            for item in read_samples(rows, tok, d.maxLength, d.format, d.limit, d.expandTurns, wanted):
                if item.index >= plan.rows:
                    return
                if item.index not in shard_of:
                    continue
                if isinstance(item, Prepared) and item.index in plan.duplicates:
                    detail = f"id {item.sample_id!r} is used by an earlier row"
                    item = Rejected(item.index, item.sample_id, Reason.DUPLICATE_ID, detail, item.line)
                emit(item)

        return read
