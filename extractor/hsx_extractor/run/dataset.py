"""Dataset rows: JSONL lines or Parquet rows in, typed samples or quarantine reasons out.

A row's *index* is its position among the file's rows (non-blank lines); with ``expandTurns`` a
row of k assistant turns holds k consecutive indices, one sample each. Indices never depend on
what happened to other rows, so the same dataset always yields the same indices (and shards).
Every outcome also carries the row's *line* (1-based, in the file, blank lines counted; the row
number for Parquet). Whatever is wrong with one row becomes its quarantine, never the run's end:
only an unreadable dataset (DatasetError) or a configuration error (tokens.TokenizerError) stops it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import DATASET_CREDENTIALS_ENV
from hsx_extractor.reasons import Reason
from hsx_extractor.run.row_bounds import (
    MAX_JSON_DEPTH,
    ROW_BYTES_PER_TOKEN,
    nested_deeper_than,
    row_bytes_limit,
    row_size,
)
from hsx_extractor.run.sources import SourceRow, iter_rows
from hsx_extractor.storage.s3_client import S3Endpoint

ROLES = frozenset({"system", "user", "assistant", "tool"})
# ShareGPT speakers -> roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "observation": "tool",
}
# Message fields passed to the chat template; others are dropped.
OPTIONAL_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning_content")
# Sample ids travel in every shard header and commit record: a long one is a bad row, not a 100 MB header.
MAX_ID_CHARS = 512
RowFormat = Literal["auto", "messages", "tokens"]


class ConfigurationError(RuntimeError):
    """The run's configuration, not the row, is wrong (found at the first row that needs it): the
    run stops with the permanent exit code instead of quarantining every row the same way."""


class RowRefused(ValueError):
    """This row (or one of its samples) cannot be a sample: a quarantine reason and its detail."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MessagesRow:
    """A chat to render with the chat template."""

    index: int
    sample_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    line: int | None = None

    @property
    def assistant_turns(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)


@dataclass(frozen=True)
class TokensRow:
    """A pre-tokenized sample, taken as given."""

    index: int
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    line: int | None = None


@dataclass(frozen=True)
class Rejected:
    """A row (or one turn's sample of it) that becomes no sample, and why."""

    index: int
    sample_id: str | None
    reason: Reason
    detail: str
    line: int | None = None


@dataclass(frozen=True)
class Prepared:
    """A sample ready to send: the exact tokens the server will run and the loss mask."""

    index: int
    sample_id: str
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    line: int | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


Sample = tuple[np.ndarray, np.ndarray]  # (input_ids int32 [L], loss_mask uint8 [L])


class Renderer(Protocol):
    """What preparing a row needs from a tokenizer (see tokens.ChatTokenizer)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None:
        """The BOS every sample must start with exactly once (None: the template writes none)."""
        ...

    def chat_samples(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, expand: bool
    ) -> list[Sample | RowRefused]:
        """One (ids, mask) per assistant turn when ``expand``, else one for the whole chat."""
        ...


def dataset_endpoint(cfg: ExtractConfig, environ: Mapping[str, str] = os.environ) -> S3Endpoint:
    """The store the dataset is read from: the dataset's own settings, the output's where unset.

    Credentials: the dataset's own (DATASET_CREDENTIALS_ENV) when given, else the AWS chain, which
    carries the output's."""
    d, o = cfg.dataset, cfg.output
    key, secret, token = (environ.get(name) for name in DATASET_CREDENTIALS_ENV)
    return S3Endpoint(
        endpoint=d.endpoint if d.endpoint is not None else o.endpoint,
        region=d.region if d.region is not None else o.region,
        path_style=d.pathStyle if d.pathStyle is not None else o.pathStyle,
        credentials=(key, secret, token or None) if key and secret else None,
    )


def dataset_rows(cfg: ExtractConfig) -> Iterator[SourceRow]:
    """The configured dataset's rows in file order, each past the row-size bound an OversizedRow."""
    return iter_rows(cfg.dataset.uri, dataset_endpoint(cfg), row_bytes_limit(cfg.dataset.maxLength))


def _sample_id(row: dict[str, Any], index: int) -> str | None:
    value = row.get("id")
    if value is None:
        return f"#{index}"
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return str(value)


def _lone_surrogate(value: Any, where: str) -> str | None:
    """Where a string holds a lone surrogate (it cannot be UTF-8), if anywhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{where} holds a lone surrogate {value[exc.start]!r} at character {exc.start}"
        return None
    if isinstance(value, dict):
        items: Iterable[tuple[str, Any]] = value.items()
    elif isinstance(value, list):
        items = ((f"[{n}]", v) for n, v in enumerate(value))
    else:
        return None
    for key, item in items:
        found = _lone_surrogate(key, f"{where} key") or _lone_surrogate(item, f"{where}.{key}")
        if found:
            return found
    return None


def _json_list(value: Any) -> Any:
    # Parquet exports often carry nested lists as JSON text; text that is not (or nests absurdly) stays
    # text, which the caller refuses as not a list.
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return value
        return value if nested_deeper_than(parsed) else parsed
    return value


def _check_tools(value: Any) -> list[dict[str, Any]] | str | None:
    """The row's tool schemas, or what is wrong with them."""
    value = _json_list(value)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        return "tools is not a list of objects"
    return value


def _check_message(n: int, message: Any) -> tuple[Reason, str] | dict[str, Any]:
    if not isinstance(message, dict):
        return Reason.INVALID_ROW, f"message {n} is not an object"
    if message.get("role") is None:
        return Reason.MISSING_ROLE, f"message {n} has no role"
    role = message["role"]
    if not isinstance(role, str) or role not in ROLES:
        return Reason.UNKNOWN_ROLE, f"message {n} has role {role!r}"
    clean: dict[str, Any] = {"role": role}
    for key in OPTIONAL_FIELDS:
        if message.get(key) is not None:
            clean[key] = _json_list(message[key]) if key == "tool_calls" else message[key]
    calls = clean.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list) or not calls):
        return Reason.INVALID_ROW, f"message {n}: tool_calls must be a non-empty list on an assistant message"
    if calls is not None and not all(isinstance(c, dict) for c in calls):
        return Reason.INVALID_ROW, f"message {n}: each tool call must be an object"
    reasoning = clean.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        return Reason.NON_STRING_CONTENT, f"message {n} reasoning_content is {type(reasoning).__name__}"
    content = message.get("content")
    if content is None and calls is not None:
        clean["content"] = None  # an assistant turn that only calls tools
    elif not isinstance(content, str):
        return Reason.NON_STRING_CONTENT, f"message {n} content is {type(content).__name__}"
    else:
        clean["content"] = content
    if role == "assistant" and not (content or "").strip() and calls is None and not (reasoning or "").strip():
        return Reason.EMPTY_ASSISTANT_TURN, f"message {n} is an assistant turn with no content"
    return clean


def _check_messages(
    index: int, sample_id: str, messages: Any, tools: Any, line: int | None
) -> MessagesRow | Rejected:
    if not isinstance(messages, list):
        return Rejected(index, sample_id, Reason.INVALID_ROW, "messages is not a list", line)
    if not messages:
        return Rejected(index, sample_id, Reason.EMPTY_MESSAGES, "messages is empty", line)
    clean: list[dict[str, Any]] = []
    for n, message in enumerate(messages):
        checked = _check_message(n, message)
        if isinstance(checked, tuple):
            return Rejected(index, sample_id, checked[0], checked[1], line)
        clean.append(checked)
    schemas = _check_tools(tools)
    if isinstance(schemas, str):
        return Rejected(index, sample_id, Reason.INVALID_ROW, schemas, line)
    return MessagesRow(index, sample_id, clean, schemas, line)


def _sharegpt(conversations: Any, system: Any) -> list[Any] | tuple[Reason, str]:
    """ShareGPT ``conversations`` ({from, value}) as messages ({role, content})."""
    if not isinstance(conversations, list):
        return Reason.INVALID_ROW, "conversations is not a list"
    messages: list[Any] = []
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    for n, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            return Reason.INVALID_ROW, f"conversations[{n}] is not an object"
        speaker = turn.get("from")
        if speaker is None:
            return Reason.MISSING_ROLE, f"conversations[{n}] has no 'from'"
        if not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:
            return Reason.UNKNOWN_ROLE, f"conversations[{n}] is from {speaker!r}"
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    return messages


def _is_int_list(value: Any) -> bool:
    # set(map(type, ...)) runs in C: the per-token isinstance loop cost ~0.1 core-s per GB of states
    # in the benchmark (issue 17). A JSON true/false is a bool, not an int: refused.
    return isinstance(value, list) and set(map(type, value)) <= {int}


def _check_tokens(index: int, sample_id: str, ids: Any, mask: Any, line: int | None) -> TokensRow | Rejected:
    if not _is_int_list(ids):
        return Rejected(index, sample_id, Reason.INVALID_ROW, "input_ids is not a list of integers", line)
    if not _is_int_list(mask) or not set(mask) <= {0, 1}:
        return Rejected(index, sample_id, Reason.INVALID_ROW, "loss_mask is not a list of 0/1", line)
    if len(mask) != len(ids):
        detail = f"loss_mask has {len(mask)} entries, input_ids {len(ids)}"
        return Rejected(index, sample_id, Reason.MASK_LENGTH_MISMATCH, detail, line)
    return TokensRow(index, sample_id, ids, mask, line)


def _decode(index: int, raw: bytes, line: int | None) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejected(index, None, Reason.INVALID_UTF8, f"byte {exc.start} is not UTF-8", line)
    try:
        row = json.loads(text)
    except ValueError as exc:
        return Rejected(index, None, Reason.INVALID_JSON, str(exc), line)
    except RecursionError:
        return Rejected(index, None, Reason.INVALID_JSON, "JSON nested too deeply", line)
    if nested_deeper_than(row):
        return Rejected(index, None, Reason.INVALID_JSON, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", line)
    # Valid UTF-8 can still spell a lone surrogate as a JSON escape; such text has no UTF-8 form.
    try:
        found = _lone_surrogate(row, "row") if "\\u" in text else None
    except RecursionError:
        return Rejected(index, None, Reason.INVALID_JSON, "JSON nested too deeply", line)
    if found:
        return Rejected(index, None, Reason.INVALID_UTF8, found, line)
    return row


def parse_row(
    index: int, raw: bytes | dict[str, Any], fmt: RowFormat = "auto", line: int | None = None
) -> MessagesRow | TokensRow | Rejected:
    """One JSONL line (or decoded Parquet row) to a typed row, or the reason it is rejected. Pure."""
    row = _decode(index, raw, line) if isinstance(raw, bytes) else raw
    if isinstance(row, Rejected):
        return row
    if not isinstance(raw, bytes) and nested_deeper_than(row):  # a decoded Parquet row
        return Rejected(index, None, Reason.INVALID_JSON, f"row nested deeper than {MAX_JSON_DEPTH} levels", line)
    if not isinstance(row, dict):
        return Rejected(index, None, Reason.INVALID_ROW, f"row is a JSON {type(row).__name__}, not an object", line)
    sample_id = _sample_id(row, index)
    if sample_id is None:
        return Rejected(index, None, Reason.INVALID_ROW, "id is neither a string nor an integer", line)
    if len(sample_id) > MAX_ID_CHARS:
        detail = f"id is {len(sample_id)} characters, more than {MAX_ID_CHARS}"
        return Rejected(index, None, Reason.INVALID_ROW, detail, line)
    kinds = [k for k in ("input_ids", "messages", "conversations") if row.get(k) is not None]
    if len(kinds) > 1:
        detail = f"row has both {kinds[0]} and {kinds[1]}: which one is the sample is ambiguous"
        return Rejected(index, sample_id, Reason.AMBIGUOUS_ROW, detail, line)
    kind = kinds[0] if kinds else None
    if kind == "input_ids" and fmt != "messages":
        return _check_tokens(index, sample_id, row["input_ids"], row.get("loss_mask"), line)
    if kind == "messages" and fmt != "tokens":
        return _check_messages(index, sample_id, row["messages"], row.get("tools"), line)
    if kind == "conversations" and fmt != "tokens":
        messages = _sharegpt(row["conversations"], row.get("system"))
        if isinstance(messages, tuple):
            return Rejected(index, sample_id, messages[0], messages[1], line)
        return _check_messages(index, sample_id, messages, row.get("tools"), line)
    wanted = {
        "auto": "messages, conversations or input_ids",
        "messages": "messages or conversations",
        "tokens": "input_ids",
    }[fmt]
    return Rejected(index, sample_id, Reason.INVALID_ROW, f"row has no {wanted}", line)


def sample_count(row: MessagesRow | TokensRow | Rejected, expand: bool) -> int:
    """How many indices (samples) a row holds: its assistant turns when expanded, else one."""
    if expand and isinstance(row, MessagesRow):
        return max(1, row.assistant_turns)
    return 1


def _check_bos(ids: np.ndarray, bos: int | None, rendered: bool) -> str | None:
    if bos is None:
        return None
    if ids.shape[0] == 0 or ids[0] != bos:
        return f"the sample does not start with BOS (id {bos}), which the chat template writes"
    if rendered:
        count = int((ids == bos).sum())
        return f"the sample holds BOS {count} times" if count > 1 else None
    if ids.shape[0] > 1 and ids[1] == bos:
        return "the sample starts with BOS twice"
    return None


def finish_sample(row: MessagesRow | TokensRow, index: int, sample_id: str, sample: Sample | RowRefused,
            tokenizer: Renderer, max_length: int) -> Prepared | Rejected:
    if isinstance(sample, RowRefused):
        return Rejected(index, sample_id, sample.reason, sample.detail, row.line)
    ids, mask = sample
    bad_bos = _check_bos(ids, tokenizer.bos_id, isinstance(row, MessagesRow))
    if bad_bos:
        return Rejected(index, sample_id, Reason.BOS_MISMATCH, bad_bos, row.line)
    if ids.shape[0] > max_length:
        detail = f"{ids.shape[0]} tokens > maxLength {max_length}"
        return Rejected(index, sample_id, Reason.TOO_LONG, detail, row.line)
    if not mask.any():
        return Rejected(index, sample_id, Reason.NO_ASSISTANT_TOKENS, "loss mask is all zero", row.line)
    return Prepared(index, sample_id, ids, mask, row.line)


def prepare_samples(
    row: MessagesRow | TokensRow, tokenizer: Renderer, max_length: int, expand: bool = False
) -> list[Prepared | Rejected]:
    """Every sample of a parsed row (``sample_count`` of them), prepared or rejected. Never truncates."""
    if isinstance(row, TokensRow):
        vocab = tokenizer.vocab_size
        try:
            ids = np.asarray(row.input_ids, dtype=np.int64)
            outside = (ids < 0) | (ids >= vocab)
        except OverflowError:  # an id beyond int64: outside the vocabulary too, found the slow way
            outside = np.array([not 0 <= i < vocab for i in row.input_ids])
        if outside.any():
            first = row.input_ids[int(np.argmax(outside))]
            detail = f"{int(outside.sum())} ids outside [0, {vocab}), first {first}"
            return [Rejected(row.index, row.sample_id, Reason.IDS_OUT_OF_VOCAB, detail, row.line)]
        sample = (ids.astype(np.int32), np.asarray(row.loss_mask, dtype=np.uint8))
        return [finish_sample(row, row.index, row.sample_id, sample, tokenizer, max_length)]
    if row.assistant_turns == 0:
        detail = "the conversation has no assistant turn"
        return [Rejected(row.index, row.sample_id, Reason.NO_ASSISTANT_TOKENS, detail, row.line)]
    samples = tokenizer.chat_samples(row.messages, row.tools, expand)
    if not expand:
        return [finish_sample(row, row.index, row.sample_id, samples[0], tokenizer, max_length)]
    return [
        finish_sample(row, row.index + k, f"{row.sample_id}/turn{k + 1}", sample, tokenizer, max_length)
        for k, sample in enumerate(samples)
    ]


def prepare(row: MessagesRow | TokensRow, tokenizer: Renderer, max_length: int) -> Prepared | Rejected:
    """Tokens and loss mask of a parsed row (one sample for the whole chat), or why it cannot be one."""
    return prepare_samples(row, tokenizer, max_length)[0]


def read_samples(
    rows: Iterable[SourceRow | bytes],
    tokenizer: Renderer,
    max_length: int,
    fmt: RowFormat = "auto",
    limit: int | None = None,
    expand: bool = False,
    wanted: Callable[[int], bool] | None = None,
    prepare: Callable[[MessagesRow | TokensRow, Renderer, int, bool], list[Prepared | Rejected]] | None = None,
) -> Iterator[Prepared | Rejected]:
    """Every sample of the dataset, prepared or rejected, in index order (no duplicate check: see plan).

    ``limit`` counts rows; ``wanted`` (an index predicate) skips rendering rows none of whose
    indices it wants (they are not yielded); ``prepare``: how a parsed row becomes its samples
    (prepare_samples; a regenerating run's prompts: run/regenerate.py)."""
    prepare = prepare or prepare_samples
    index = 0
    for number, source in enumerate(rows):
        if limit is not None and number >= limit:
            return
        raw, line = (source, None) if isinstance(source, bytes) else (source.data, source.line)
        size = row_size(raw)
        if size > row_bytes_limit(max_length):
            detail = (
                f"row is {'at least ' if isinstance(raw, dict) else ''}{size} bytes, more than "
                f"{row_bytes_limit(max_length)} ({ROW_BYTES_PER_TOKEN} per token of maxLength {max_length}); not parsed"
            )
            row: MessagesRow | TokensRow | Rejected = Rejected(index, None, Reason.TOO_LONG, detail, line)
        else:
            row = _guarded(index, 1, line, lambda *a: [parse_row(*a)], index, raw, fmt, line)[0]
        count = sample_count(row, expand)
        if wanted is None or any(wanted(i) for i in range(index, index + count)):
            if isinstance(row, Rejected):
                yield row
            else:
                yield from _guarded(index, count, line, prepare, row, tokenizer, max_length, expand)
        index += count


def _guarded(index: int, count: int, line: int | None, judge: Callable[..., list[Any]], *args: Any) -> list[Any]:
    """``judge(*args)``, or, if it raises anything, the ``count`` samples from ``index`` quarantined with
    the error: one row can never end a run (only configuration errors do, and those are found at start)."""
    try:
        return judge(*args)
    except ConfigurationError:
        raise
    except Exception as exc:
        detail = f"{type(exc).__name__} while checking the row: {str(exc)[:300]}"
        return [Rejected(index + k, None, Reason.ROW_CHECK_FAILED, detail, line) for k in range(count)]
