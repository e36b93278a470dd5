"""responses: regenerate (issue 36): the target model writes each row's assistant turns, then hsx
captures prompt + generated response exactly as it captures a dataset's own responses.

Per shard, in order:
1. the reader renders each row's generation prompt (:func:`prompt_preparer`); the plan cuts shards by
   prompt + ``generation.maxNewTokens`` per turn (at most ``dataset.maxLength``), a bound on the sample;
2. once a shard's rows are all read, :class:`Regenerator` generates them (the same server, at most
   ``concurrency`` requests, no dump written) and stores the shard's generations,
   ``generations/shard-{k:06d}.jsonl`` (storage/layout.py), write-if-absent, *before* any of its capture;
   a shard whose generations are already stored (a restart, another replica) is never generated again,
   and a process that loses the race to store them captures the stored ones, not its own;
3. each stored row is re-rendered with the chat template (:func:`sample_of`): the capture is that
   rendering, and it must hold the prompt's ids followed by the generated ids, else the row is
   quarantined (generation_not_rerenderable). So a capture is always paired with its stored generation.

Each line of a generations file is one row: ``index``, ``id``, ``line`` (the dataset's), ``messages``
(the regenerated conversation, a dataset row hsx reads as it is), ``tools``, ``turns`` (per generated
turn: ``message`` index, ``promptTokens``, ``outputIds`` as generated, ``finish``), ``plan`` (the run's
settings digest) and, for a row that cannot be a sample, ``quarantine`` (``reason``, ``detail``). Before its
capture each stored row is checked to be this run's (:func:`stale`): same id, dataset turns and settings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from hsx_extractor.config import ExtractConfig, GenerationSpec
from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import (
    ConfigurationError,
    MessagesRow,
    Prepared,
    Rejected,
    RowRefused,
    TokensRow,
    finish_sample,
    read_samples,
)
from hsx_extractor.run.engine import ReaderEvent, ShardResumed, ShardRow
from hsx_extractor.run.failures import RunFailed, permanent
from hsx_extractor.run.plan import ShardCut
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.server_client import (
    Generated,
    RequestRejected,
    Sampling,
    ServerClient,
    ServerUnavailable,
)
from hsx_extractor.run.sources import SourceRow
from hsx_extractor.run.tokens import ChatTokenizer
from hsx_extractor.run.validate import MismatchGate
from hsx_extractor.storage import failpoints
from hsx_extractor.storage.backends import PermanentStoreError
from hsx_extractor.storage.store import MAX_NAMED_JSON_BYTES, Store

# Tokens the template adds after a turn's text (its end-of-turn and separator), bounded for planning.
END_OF_TURN_TOKENS = 16


@dataclass(frozen=True)
class Prompt(Prepared):
    """A row to regenerate: ``input_ids`` is its first turn's generation prompt (mask all zero)."""

    messages: tuple[dict[str, Any], ...] = ()
    tools: list[dict[str, Any]] | None = None
    # Message indices of the turns to generate, in order (one past the last message: a new turn).
    targets: tuple[int, ...] = ()
    # The sample's most tokens once generated: what the plan sizes shards by.
    bound: int = 0
    # Its tokens but the generated ones (the prompt; for turns: each, the whole dataset conversation).
    context: int = 0

    @property
    def length(self) -> int:
        return self.bound


def regenerated_turns(messages: list[dict[str, Any]], turns: str) -> list[int]:
    """Which messages are generated (pure): ``last``, the final assistant turn, or a new turn after a
    final user or tool turn; ``each``, every assistant turn and such a new one. Turns that call tools
    keep the dataset's call (the tool results after them answer it)."""
    own = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    final = messages[-1]
    if final["role"] != "assistant":
        own.append(len(messages))
    elif final.get("tool_calls") and turns == "last":
        return []  # the last turn is the dataset's call
    return own[-1:] if turns == "last" else own


def prompt_preparer(gen: GenerationSpec) -> Callable[..., list[Prepared | Rejected]]:
    """read_samples' ``prepare`` for a regenerating run: a row becomes its first generation prompt."""

    def prepare(row: MessagesRow | TokensRow, tok: ChatTokenizer, max_length: int, _expand: bool) -> list[Any]:
        def refused(reason: Reason, detail: str) -> list[Any]:
            return [Rejected(row.index, row.sample_id, reason, detail, row.line)]

        if isinstance(row, TokensRow):
            return refused(Reason.INVALID_ROW, "an input_ids row has no turns to regenerate (responses: regenerate)")
        if tok.mode == "quarantine" and (found := tok.special_text(row.messages, row.tools)):
            return refused(Reason.SPECIAL_TOKENS_IN_CONTENT, f"content holds the special-token string {found!r}")
        targets = regenerated_turns(row.messages, gen.turns)
        if not targets:
            return refused(Reason.NO_ASSISTANT_TOKENS, "nothing to regenerate: its last turn calls a tool (turns: last)")
        try:
            prompt = tok.encode_chat(row.messages[: targets[0]], row.tools, True).ids
            whole = len(prompt) if len(targets) == 1 else len(tok.encode_chat(row.messages, row.tools, False).ids)
        except RowRefused as exc:
            return refused(exc.reason, exc.detail)
        if len(prompt) + END_OF_TURN_TOKENS >= max_length:
            return refused(Reason.TOO_LONG, f"the generation prompt alone is {len(prompt)} tokens, maxLength {max_length}")
        bound = min(whole + len(targets) * (gen.maxNewTokens + END_OF_TURN_TOKENS), max_length)
        ids = np.asarray(prompt, dtype=np.int32)
        return [Prompt(row.index, row.sample_id, ids, np.zeros_like(ids, dtype=np.uint8), row.line,
                       tuple(row.messages), row.tools, tuple(targets), bound, whole)]  # fmt: skip

    return prepare


def row_samples(
    cfg: ExtractConfig, rows: Iterable[SourceRow], tok: ChatTokenizer, wanted: Callable[[int], bool] | None = None
) -> Iterator[Prepared | Rejected]:
    """The dataset's samples as this run reads them: the dataset's responses, or prompts to regenerate."""
    d = cfg.dataset
    prepare = prompt_preparer(cfg.generation) if cfg.responses == "regenerate" else None
    return read_samples(rows, tok, d.maxLength, d.format, d.limit, d.expandTurns, wanted, prepare)


def content_ids(turn: dict[str, Any], special: frozenset[int]) -> list[int]:
    """The generated ids that are the turn's text: without the end-of-turn token it stopped on."""
    ids: list[int] = turn["outputIds"]
    return ids[:-1] if turn["finish"] == "stop" and ids and ids[-1] in special else ids


def sample_of(record: dict[str, Any], tok: ChatTokenizer, max_length: int) -> Prepared | Rejected:
    """The sample a stored generation captures: its conversation rendered by the chat template, which
    must hold each turn's prompt ids followed by its generated ids; else why it is quarantined. Whatever
    judging it raises quarantines the row (as dataset._guarded does): one row never ends a run."""
    index, sample_id, line = record["index"], record["id"], record.get("line")
    try:
        return _sample_of(record, tok, max_length)
    except ConfigurationError:
        raise
    except RowRefused as exc:
        return Rejected(index, sample_id, exc.reason, exc.detail, line)
    except Exception as exc:
        detail = f"{type(exc).__name__} while checking the generation: {str(exc)[:300]}"
        return Rejected(index, sample_id, Reason.ROW_CHECK_FAILED, detail, line)


def _sample_of(record: dict[str, Any], tok: ChatTokenizer, max_length: int) -> Prepared | Rejected:
    index, sample_id, line = record["index"], record["id"], record.get("line")
    if (quarantine := record.get("quarantine")) is not None:
        return Rejected(index, sample_id, Reason(quarantine["reason"]), quarantine["detail"], line)
    messages, tools = record["messages"], record.get("tools")
    row = MessagesRow(index, sample_id, messages, tools, line)
    sample = tok.chat_samples(messages, tools, False)[0]
    if not isinstance(sample, RowRefused):
        rendered = sample[0]
        for turn in record["turns"]:
            expected = tok.encode_chat(messages[: turn["message"]], tools, True).ids + content_ids(turn, tok.special_ids)
            got = rendered[: len(expected)].tolist()
            if got != expected:
                at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), len(got))
                detail = (f"message {turn['message']}: the chat template re-renders the generated text to other ids "
                          f"from token {at} ({got[at:at + 4]} instead of {expected[at:at + 4]})")  # fmt: skip
                return Rejected(index, sample_id, Reason.GENERATION_NOT_RERENDERABLE, detail, line)
    return finish_sample(row, index, sample_id, sample, tok, max_length)


def _put(q: queue.Queue[_Gathering | None], item: _Gathering | None) -> bool:
    try:
        q.put(item, timeout=1.0)
        return True
    except queue.Full:
        return False


def _get_nowait(q: queue.Queue[_Gathering | None]) -> _Gathering | None:
    try:
        return q.get_nowait()
    except queue.Empty:
        return None


def generations_stored(store: Store) -> Callable[[int], bool]:
    """Whether shard k's generations are stored: only then may an idle process race it (run/leases), as a
    race before that would decode the shard twice and throw one decode away."""
    return lambda shard: store.backend.size(store.layout.generations_key(shard)) is not None


def stale(record: dict[str, Any] | None, item: Prompt, plan: str | None) -> str | None:
    """Why a stored generation is not this row's (pure): none stored for it, made with other settings (a
    run restarted with others before plan.json was stored), or its dataset turns changed since."""
    if record is None or record.get("id") != item.sample_id:
        return "its shard's generations file does not hold it: the dataset changed since they were stored"
    made = record.get("plan")
    if plan is not None and made is not None and made != plan:
        return (f"its generation was made with other settings (plan digest {made}, this run's {plan}: model, "
                "tokenizer, generation or capture options)")  # fmt: skip
    kept = record.get("messages") or []
    if record.get("tools") != item.tools or any(
        i >= len(kept) or kept[i] != m for i, m in enumerate(item.messages) if i not in item.targets
    ):
        return "its dataset turns changed since its generation was stored"
    return None


def encode_records(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)


def decode_records(data: bytes, where: str) -> dict[int, dict[str, Any]]:
    """A stored generations file, by row index."""
    try:
        records = [json.loads(line) for line in data.splitlines() if line.strip()]
        return {int(r["index"]): r for r in records}
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise PermanentStoreError(f"{where} is not a generations file: {exc}") from exc


@dataclass
class _Gathering:
    cut: ShardCut | None = None
    items: list[Prepared | Rejected] = field(default_factory=list)
    # Its generations being made on the loop (None: already stored), and when they began.
    making: concurrent.futures.Future[list[dict[str, Any]]] | None = None
    began: float = 0.0


# A generation the server aborts is asked this many times more (pausing 2, 4, 8 s) before its row is
# quarantined, unless the server aborts most generations (the abort gate: then the run stops, transient).
ABORT_RETRIES, ABORT_PAUSE_S = 3, 2.0
# The generation's own gate (apart from the capture's, which it would dilute): refusals stop the run when
# they are more than this share of the recent requests, a setting the server does not take, not a row.
GENERATION_REFUSAL_RATE = 0.5
REFUSED = "generation requests refused"
REFUSED_ADVICE = "the server does not take a generation setting (temperature, top_p, stop, maxNewTokens) or the model"

# Shards read whole whose generations may be under way at once: the next shard's requests reach the
# server while the last rows of one are still decoding, so the decode batch does not drain every shard.
GENERATE_AHEAD = 2


class Regenerator:
    """Between the reader and the engine: holds each shard's rows until its generations are stored,
    then hands the engine the samples they render to. The reader thread gathers shards and starts their
    generations (the requests run on the engine's event loop, ``loop``); a thread of its own waits for
    them in order, stores them and hands each shard on, so the reader never waits on a generation (it
    may be waiting in leases.work_left for the very shards it holds). ``stop_reading`` (Leases.stop)
    ends that wait when handing on fails."""

    def __init__(self, cfg: ExtractConfig, tok: ChatTokenizer, store: Store, client: ServerClient, progress: Progress,
                 loop: asyncio.AbstractEventLoop, stop_reading: Callable[[], None]) -> None:  # fmt: skip
        self.cfg, self.tok, self.store, self.client, self.progress, self.loop = cfg, tok, store, client, progress, loop
        self.gen, self.stop_reading = cfg.generation, stop_reading
        v = cfg.validation
        self.gate = MismatchGate(GENERATION_REFUSAL_RATE, v.gateWindow, v.gateMinSamples)
        self.aborts = MismatchGate(GENERATION_REFUSAL_RATE, v.gateWindow, v.gateMinSamples)

    def reader(self, inner: Callable[[Callable[[ReaderEvent], None]], None]) -> Callable[[Callable[[ReaderEvent], None]], None]:
        def read(emit: Callable[[ReaderEvent], None]) -> None:
            waiting: dict[int, _Gathering] = {}
            whole: queue.Queue[_Gathering | None] = queue.Queue(maxsize=GENERATE_AHEAD)
            failed: list[BaseException] = []

            def hand_on() -> None:
                try:
                    while (held := whole.get()) is not None:
                        assert held.cut is not None
                        samples = self.shard_samples(held)
                        emit(held.cut)
                        for item in samples:
                            emit(ShardRow(held.cut.shard, item))
                except BaseException as exc:
                    failed.append(exc)
                    self.stop_reading()
                    while (rest := _get_nowait(whole)) is not None:
                        if rest.making is not None:
                            rest.making.cancel()

            def take(event: ReaderEvent) -> None:
                if failed:
                    raise failed[0]
                if isinstance(event, ShardResumed):
                    emit(event)
                    return
                held = waiting.setdefault(event.shard, _Gathering())
                if isinstance(event, ShardCut):
                    held.cut = event
                else:
                    held.items.append(event.item)
                if held.cut is not None and len(held.items) == held.cut.stop - held.cut.start:
                    del waiting[event.shard]
                    self.start(held)
                    while not _put(whole, held):
                        if failed:
                            if held.making is not None:  # never handed on: its generations would only cost decode
                                held.making.cancel()
                            raise failed[0]

            handing = threading.Thread(target=hand_on, name="hsx-regenerate", daemon=True)
            handing.start()
            try:
                inner(take)
            finally:
                while handing.is_alive() and not _put(whole, None):
                    pass
                handing.join()
            if failed:
                raise failed[0]
            for held in waiting.values():  # rows missing (the dataset shrank): the engine says which shards
                if held.cut is not None:
                    emit(held.cut)

        return read

    def start(self, held: _Gathering) -> None:
        """Begin the shard's generations unless they are stored already."""
        assert held.cut is not None
        key = self.store.layout.generations_key(held.cut.shard)
        if self.store.backend.size(key) is None:
            prompts = [i for i in held.items if isinstance(i, Prompt)]
            held.making = asyncio.run_coroutine_threadsafe(self._generate_all(prompts, held.cut.plan), self.loop)
            held.began = time.monotonic()

    def shard_samples(self, held: _Gathering) -> list[Prepared | Rejected]:
        """The shard's rows as samples to capture, from its stored generations (stored now if just made)."""
        assert held.cut is not None
        shard = held.cut.shard
        key = self.store.layout.generations_key(shard)
        where = f"{self.store.backend.description}/{key}"
        if held.making is not None:
            made = encode_records(held.making.result())
            if not self.store.backend.put_if_absent(key, made):  # another process stored its generations first
                print(f"hsx: shard {shard}: generations stored by another process; those are captured", flush=True)
            failpoints.reach("generations-stored")
            rows = sum(isinstance(i, Prompt) for i in held.items)
            print(f"hsx: shard {shard}: {rows} rows generated in {time.monotonic() - held.began:.1f}s", flush=True)
        data = self.store.backend.get(key, MAX_NAMED_JSON_BYTES)
        if data is None:
            raise PermanentStoreError(f"{where}: stored (or found) but gone when read back")
        stored = decode_records(data, where)
        out: list[Prepared | Rejected] = []
        for item in held.items:
            if not isinstance(item, Prompt):
                out.append(item)
                continue
            record = stored.get(item.index)
            if (why := stale(record, item, held.cut.plan)) is not None:
                raise permanent(f"{where}: row {item.index} ({item.sample_id}): {why}; restore the dataset and "
                                "settings, or start a new runId")  # fmt: skip
            assert record is not None
            out.append(sample_of(record, self.tok, self.cfg.dataset.maxLength))
        return out

    async def _generate_all(self, prompts: list[Prompt], plan: str | None) -> list[dict[str, Any]]:
        """Every row of a shard; the first error (the server gone, the gate's verdict) cancels the rest.
        Whatever else one row raises quarantines it: one row never ends a run."""

        async def one(prompt: Prompt) -> dict[str, Any]:
            try:
                record = await self._generate(prompt)
            except (ServerUnavailable, RunFailed, ConfigurationError, aiohttp.ClientError, OSError):
                raise  # the server's, the run's or the store's: not this row's
            except Exception as exc:
                detail = f"{type(exc).__name__} while generating: {str(exc)[:300]}"
                record = {"index": prompt.index, "id": prompt.sample_id, "line": prompt.line,
                          "messages": list(prompt.messages), "turns": [],
                          **({"tools": prompt.tools} if prompt.tools is not None else {}),
                          "quarantine": {"reason": str(Reason.ROW_CHECK_FAILED), "detail": detail}}  # fmt: skip
            if plan is not None:
                record["plan"] = plan
            self.progress.generated(0, 0, rows=1)
            return record

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(p)) for p in prompts]
        return [t.result() for t in tasks]

    async def _generate(self, prompt: Prompt) -> dict[str, Any]:
        """One row's turns, generated in order, each from the conversation regenerated so far."""
        gen, tok = self.gen, self.tok
        messages = [dict(m) for m in prompt.messages]
        record: dict[str, Any] = {"index": prompt.index, "id": prompt.sample_id, "line": prompt.line, "turns": []}
        if prompt.tools is not None:
            record["tools"] = prompt.tools

        def quarantine(reason: Reason, detail: str) -> dict[str, Any]:
            record["quarantine"] = {"reason": str(reason), "detail": detail}
            record["messages"] = messages
            return record

        for n, target in enumerate(prompt.targets):
            try:
                ids = prompt.input_ids.tolist() if n == 0 else (
                    await asyncio.to_thread(tok.encode_chat, messages[:target], prompt.tools, True)).ids
            except RowRefused as exc:  # the template refuses the conversation the earlier turns made
                return quarantine(exc.reason, f"message {target}: {exc.detail}")
            room = min(gen.maxNewTokens, self.cfg.dataset.maxLength - len(ids) - END_OF_TURN_TOKENS)
            if room < 1:
                return quarantine(Reason.TOO_LONG, f"message {target}: its prompt is {len(ids)} tokens, no room "
                                                   f"left under maxLength {self.cfg.dataset.maxLength}")  # fmt: skip
            seed = None if gen.seed is None else gen.seed + prompt.index
            sampling = Sampling(room, gen.temperature, gen.topP, seed, tuple(gen.stop))
            try:
                got = await self._complete(ids, sampling)
            except RequestRejected as exc:  # this request's fault (a prompt the server will not take): the gate
                self.gate.record(True)        # stops the run when it is most requests' (a setting it refuses)
                if verdict := self.gate.verdict(REFUSED, REFUSED_ADVICE):
                    raise permanent(f"generation: {verdict}; last: {exc}") from exc
                return quarantine(Reason.SERVER_ERROR, f"message {target}: generation refused: {exc}")
            self.gate.record(False)
            aborted = got.finish not in ("stop", "length")
            self.aborts.record(aborted)
            if aborted and (verdict := self.aborts.verdict("generations aborted", "the server is overloaded or "
                                                           "restarting, not refusing rows")):  # fmt: skip
                raise ServerUnavailable(f"generation: {verdict}")
            if aborted:
                return quarantine(Reason.SERVER_ERROR, f"message {target}: the server ended its generation with "
                                  f"{got.finish!r} {1 + ABORT_RETRIES} times")  # fmt: skip
            self.progress.generated(len(got.ids), len(ids))
            failpoints.reach("generated")
            turn = {"message": target, "promptTokens": len(ids), "outputIds": got.ids, "finish": got.finish}
            record["turns"].append(turn)
            text = tok.decode(content_ids(turn, tok.special_ids))
            messages[target : target + 1] = [{"role": "assistant", "content": text}]
            if got.finish == "length" and gen.onTruncated == "quarantine":
                return quarantine(Reason.TRUNCATED_GENERATION, f"message {target}: {len(got.ids)} tokens generated "
                                  f"without a stop (generation.maxNewTokens {gen.maxNewTokens}, or maxLength)")  # fmt: skip
            if not text.strip():
                return quarantine(Reason.EMPTY_GENERATION, f"message {target}: the model generated no text")
        record["messages"] = messages
        return record

    async def _complete(self, ids: list[int], sampling: Sampling) -> Generated:
        """A generation, asked again (after a pause) while the server aborts it: an abort under load or a
        restart is not the row's, one that repeats is (its finish is then the row's quarantine)."""
        for attempt in range(ABORT_RETRIES + 1):
            if attempt:
                await asyncio.sleep(ABORT_PAUSE_S * 2 ** (attempt - 1))
            got = await self.client.complete(ids, sampling)
            if got.finish in ("stop", "length"):
                break
        return got
