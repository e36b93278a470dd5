"""Dataset rows: JSONL lines in, a typed row or a quarantine reason out.

A row's *index* is its position among the file's non-blank lines; it never depends on what
happened to other rows, so the same dataset always yields the same indices (and shards).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import DATASET_CREDENTIALS_ENV
from hsx_extractor.reasons import Reason
from hsx_extractor.storage.s3_client import S3Endpoint
from hsx_extractor.storage.store import open_uri_lines

ROLES = frozenset({"system", "user", "assistant", "tool"})
RowFormat = Literal["auto", "messages", "tokens"]


class DatasetError(RuntimeError):
    """The dataset as a whole cannot be read (missing file, unsupported URI)."""


@dataclass(frozen=True)
class MessagesRow:
    """A chat to render with the chat template."""

    index: int
    sample_id: str
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class TokensRow:
    """A pre-tokenized sample, taken as given."""

    index: int
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class Rejected:
    """A row that becomes no sample, and why."""

    index: int
    sample_id: str | None
    reason: Reason
    detail: str


@dataclass(frozen=True)
class Prepared:
    """A sample ready to send: the exact tokens the server will run and the loss mask."""

    index: int
    sample_id: str
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


class Renderer(Protocol):
    """What preparing a row needs from a tokenizer (see tokens.ChatTokenizer)."""

    @property
    def vocab_size(self) -> int: ...

    def render(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]: ...


class TemplateRefused(ValueError):
    """The chat template raised for this conversation (raise_exception in the template)."""


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


def iter_lines(uri: str, where: S3Endpoint | None = None) -> Iterator[bytes]:
    """The non-blank lines of a JSONL dataset (local path, file:// or s3://), as raw bytes."""
    if not uri.startswith("s3://") and not Path(uri.removeprefix("file://")).is_file():
        raise DatasetError(f"dataset {uri} does not exist or is not a file")
    for line in open_uri_lines(uri, where):
        if line.strip():
            yield line.rstrip(b"\r\n")


def _sample_id(row: dict[str, Any], index: int) -> str | None:
    value = row.get("id")
    if value is None:
        return f"#{index}"
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return str(value)


def _check_messages(index: int, sample_id: str, messages: Any) -> MessagesRow | Rejected:
    if not isinstance(messages, list):
        return Rejected(index, sample_id, Reason.INVALID_ROW, "messages is not a list")
    if not messages:
        return Rejected(index, sample_id, Reason.EMPTY_MESSAGES, "messages is empty")
    clean: list[dict[str, str]] = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            return Rejected(index, sample_id, Reason.INVALID_ROW, f"message {n} is not an object")
        if "role" not in message:
            return Rejected(index, sample_id, Reason.MISSING_ROLE, f"message {n} has no role")
        role = message["role"]
        if role not in ROLES:
            return Rejected(index, sample_id, Reason.UNKNOWN_ROLE, f"message {n} has role {role!r}")
        content = message.get("content")
        if not isinstance(content, str):
            kind = type(content).__name__
            return Rejected(index, sample_id, Reason.NON_STRING_CONTENT, f"message {n} content is {kind}")
        clean.append({"role": role, "content": content})
    return MessagesRow(index, sample_id, clean)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _check_tokens(index: int, sample_id: str, ids: Any, mask: Any) -> TokensRow | Rejected:
    if not _is_int_list(ids):
        return Rejected(index, sample_id, Reason.INVALID_ROW, "input_ids is not a list of integers")
    if not _is_int_list(mask) or any(m not in (0, 1) for m in mask):
        return Rejected(index, sample_id, Reason.INVALID_ROW, "loss_mask is not a list of 0/1")
    if len(mask) != len(ids):
        detail = f"loss_mask has {len(mask)} entries, input_ids {len(ids)}"
        return Rejected(index, sample_id, Reason.MASK_LENGTH_MISMATCH, detail)
    return TokensRow(index, sample_id, ids, mask)


def parse_row(index: int, raw: bytes, fmt: RowFormat = "auto") -> MessagesRow | TokensRow | Rejected:
    """One JSONL line to a typed row, or the reason it is rejected. Pure."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejected(index, None, Reason.INVALID_UTF8, f"byte {exc.start} is not UTF-8")
    try:
        row = json.loads(text)
    except ValueError as exc:
        return Rejected(index, None, Reason.INVALID_JSON, str(exc))
    if not isinstance(row, dict):
        return Rejected(index, None, Reason.INVALID_ROW, f"row is a JSON {type(row).__name__}, not an object")
    sample_id = _sample_id(row, index)
    if sample_id is None:
        return Rejected(index, None, Reason.INVALID_ROW, "id is neither a string nor an integer")
    has_tokens, has_messages = "input_ids" in row, "messages" in row
    if has_tokens and fmt != "messages":
        return _check_tokens(index, sample_id, row["input_ids"], row.get("loss_mask"))
    if has_messages and fmt != "tokens":
        return _check_messages(index, sample_id, row["messages"])
    wanted = {"auto": "messages or input_ids", "messages": "messages", "tokens": "input_ids"}[fmt]
    return Rejected(index, sample_id, Reason.INVALID_ROW, f"row has no {wanted}")


def prepare(row: MessagesRow | TokensRow, tokenizer: Renderer, max_length: int) -> Prepared | Rejected:
    """Tokens and loss mask of a parsed row, or why it cannot be a sample. Never truncates."""
    if isinstance(row, TokensRow):
        vocab = tokenizer.vocab_size
        bad = [i for i in row.input_ids if not 0 <= i < vocab]
        if bad:
            detail = f"{len(bad)} ids outside [0, {vocab}), first {bad[0]}"
            return Rejected(row.index, row.sample_id, Reason.IDS_OUT_OF_VOCAB, detail)
        ids = np.asarray(row.input_ids, dtype=np.int32)
        mask = np.asarray(row.loss_mask, dtype=np.uint8)
    else:
        try:
            ids, mask = tokenizer.render(row.messages)
        except TemplateRefused as exc:
            return Rejected(row.index, row.sample_id, Reason.TEMPLATE_ERROR, str(exc))
    if ids.shape[0] > max_length:
        detail = f"{ids.shape[0]} tokens > maxLength {max_length}"
        return Rejected(row.index, row.sample_id, Reason.TOO_LONG, detail)
    if not mask.any():
        return Rejected(row.index, row.sample_id, Reason.NO_ASSISTANT_TOKENS, "loss mask is all zero")
    return Prepared(row.index, row.sample_id, ids, mask)


def read_samples(
    lines: Iterator[bytes],
    tokenizer: Renderer,
    max_length: int,
    fmt: RowFormat = "auto",
    limit: int | None = None,
) -> Iterator[Prepared | Rejected]:
    """Every row of the dataset, prepared or rejected, in order (no duplicate check: see plan)."""
    for index, raw in enumerate(lines):
        if limit is not None and index >= limit:
            return
        row = parse_row(index, raw, fmt)
        yield row if isinstance(row, Rejected) else prepare(row, tokenizer, max_length)
