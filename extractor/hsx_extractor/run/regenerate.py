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
turn: ``message`` index, ``promptTokens``, ``outputIds`` as generated, ``finish``) and, for a row that
cannot be a sample, ``quarantine`` (``reason``, ``detail``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsx_extractor.config import ExtractConfig, GenerationSpec
from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import (
    MessagesRow,
    Prepared,
    Rejected,
    RowRefused,
    TokensRow,
    finish_sample,
    read_samples,
)
from hsx_extractor.run.engine import ReaderEvent, ShardResumed, ShardRow
from hsx_extractor.run.failures import permanent
from hsx_extractor.run.plan import ShardCut
from hsx_extractor.run.progress import Progress
from hsx_extractor.run.server_client import Generated, RequestRejected, Sampling, ServerClient
from hsx_extractor.run.sources import SourceRow
from hsx_extractor.run.tokens import ChatTokenizer
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
    elif final.get("tool_calls"):
        return []
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
            return refused(Reason.NO_ASSISTANT_TOKENS, "nothing to regenerate: the conversation ends in a tool call")
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
                       tuple(row.messages), row.tools, tuple(targets), bound)]  # fmt: skip

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
    must hold each turn's prompt ids followed by its generated ids; else why it is quarantined."""
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


def encode_records(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for r in records)


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


class Regenerator:
    """Between the reader and the engine: holds each shard's rows until its generations are stored,
    then hands the engine the samples they render to. Runs in the reader thread; the requests run
    on the engine's event loop (``loop``)."""

    def __init__(self, cfg: ExtractConfig, tok: ChatTokenizer, store: Store, client: ServerClient,
                 progress: Progress, loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self.cfg, self.tok, self.store, self.client, self.progress, self.loop = cfg, tok, store, client, progress, loop
        self.gen = cfg.generation

    def reader(self, inner: Callable[[Callable[[ReaderEvent], None]], None]) -> Callable[[Callable[[ReaderEvent], None]], None]:
        def read(emit: Callable[[ReaderEvent], None]) -> None:
            waiting: dict[int, _Gathering] = {}

            def take(event: ReaderEvent) -> None:
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
                    emit(held.cut)
                    for item in self.shard_samples(held.cut.shard, held.items):
                        emit(ShardRow(held.cut.shard, item))

            inner(take)
            for held in waiting.values():  # rows missing (the dataset shrank): the engine says which shards
                if held.cut is not None:
                    emit(held.cut)

        return read

    def shard_samples(self, shard: int, items: list[Prepared | Rejected]) -> list[Prepared | Rejected]:
        """The shard's rows as samples to capture, from its stored generations (made now if none are)."""
        key = self.store.layout.generations_key(shard)
        where = f"{self.store.backend.description}/{key}"
        data = self.store.backend.get(key, MAX_NAMED_JSON_BYTES)
        if data is None:
            prompts = [i for i in items if isinstance(i, Prompt)]
            began = time.monotonic()
            records = self._on_loop(self._generate_all(prompts))
            data = encode_records(records)
            if not self.store.backend.put_if_absent(key, data):  # another process stored its generations first
                data = self.store.backend.get(key, MAX_NAMED_JSON_BYTES)
                if data is None:
                    raise PermanentStoreError(f"{where}: conditional write refused but the object is gone")
            failpoints.reach("generations-stored")
            print(f"hsx: shard {shard}: {len(prompts)} rows generated in {time.monotonic() - began:.1f}s", flush=True)
        stored = decode_records(data, where)
        out: list[Prepared | Rejected] = []
        for item in items:
            if not isinstance(item, Prompt):
                out.append(item)
                continue
            record = stored.get(item.index)
            if record is None or record.get("id") != item.sample_id:
                raise permanent(f"{where} does not hold row {item.index} ({item.sample_id}): the dataset changed since "
                                "its generations were stored; restore it or start a new runId")  # fmt: skip
            out.append(sample_of(record, self.tok, self.cfg.dataset.maxLength))
        return out

    def _on_loop(self, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if self.loop.is_closed():
                    future.cancel()
                    raise

    async def _generate_all(self, prompts: list[Prompt]) -> list[dict[str, Any]]:
        async def one(prompt: Prompt) -> dict[str, Any]:
            record = await self._generate(prompt)
            self.progress.generated(0, 0, rows=1)
            return record

        return list(await asyncio.gather(*(one(p) for p in prompts)))

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
            ids = prompt.input_ids.tolist() if n == 0 else (
                await asyncio.to_thread(tok.encode_chat, messages[:target], prompt.tools, True)).ids
            room = min(gen.maxNewTokens, self.cfg.dataset.maxLength - len(ids) - END_OF_TURN_TOKENS)
            if room < 1:
                return quarantine(Reason.TOO_LONG, f"message {target}: its prompt is {len(ids)} tokens, no room "
                                                   f"left under maxLength {self.cfg.dataset.maxLength}")  # fmt: skip
            seed = None if gen.seed is None else gen.seed + prompt.index
            try:
                got: Generated = await self.client.complete(ids, Sampling(room, gen.temperature, gen.topP, seed,
                                                                          tuple(gen.stop)))  # fmt: skip
            except RequestRejected as exc:
                return quarantine(Reason.SERVER_ERROR, f"message {target}: generation refused: {exc}")
            self.progress.generated(len(got.ids), len(ids))
            failpoints.reach("generated")
            turn = {"message": target, "promptTokens": len(ids), "outputIds": got.ids, "finish": got.finish}
            record["turns"].append(turn)
            text = tok.decode(content_ids(turn, tok.special_ids))
            messages[target : target + 1] = [{"role": "assistant", "content": text}]
            if got.finish not in ("stop", "length"):
                return quarantine(Reason.SERVER_ERROR, f"message {target}: generation ended with {got.finish!r}")
            if got.finish == "length" and gen.onTruncated == "quarantine":
                return quarantine(Reason.TRUNCATED_GENERATION, f"message {target}: {len(got.ids)} tokens generated "
                                  f"without a stop (generation.maxNewTokens {gen.maxNewTokens}, or maxLength)")  # fmt: skip
            if not text.strip():
                return quarantine(Reason.EMPTY_GENERATION, f"message {target}: the model generated no text")
        record["messages"] = messages
        return record
