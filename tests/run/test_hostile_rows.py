"""Rows built to break the checks (issue 32, item 1): each becomes that row's quarantine, never the run's
failure, and the rows around it are still samples."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import Prepared, Rejected, read_samples
from hsx_extractor.run.row_bounds import MAX_JSON_DEPTH, nested_deeper_than

GOOD = {"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
DEEP_TEXT = "[" * 5000 + "]" * 5000  # ~10 KB: json.loads raises RecursionError on it


def lines(*rows: dict[str, Any] | bytes) -> list[bytes]:
    return [r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows]


def judged(rows: list[bytes], tokenizer: Any) -> list[Prepared | Rejected]:
    return list(read_samples(rows, tokenizer, 512))


@pytest.mark.parametrize(
    "bad",
    [
        {**GOOD, "id": "tools", "tools": DEEP_TEXT},
        {"id": "calls", "messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": None, "tool_calls": DEEP_TEXT}]},
        {**GOOD, "id": "deep-tools", "tools": json.dumps([{"a": json.loads("[" * 150 + "]" * 150)}])},
    ],
    ids=["tools-as-deep-json-text", "tool-calls-as-deep-json-text", "tool-schema-150-levels"],
)  # fmt: skip
def test_json_text_nested_beyond_reason_is_refused_as_not_a_list(bad: dict[str, Any], tokenizer: Any) -> None:
    got = judged(lines(GOOD, bad, GOOD), tokenizer)
    assert [type(g).__name__ for g in got] == ["Prepared", "Rejected", "Prepared"], got
    assert got[1].reason == Reason.INVALID_ROW and "list" in got[1].detail


def test_a_row_nested_deeper_than_the_limit_is_invalid_json(tokenizer: Any) -> None:
    deep = b'{"id": "d", "messages": ' + b"[" * 900 + b"]" * 900 + b"}"
    got = judged(lines(GOOD, deep), tokenizer)
    assert isinstance(got[1], Rejected) and got[1].reason == Reason.INVALID_JSON
    assert f"deeper than {MAX_JSON_DEPTH}" in got[1].detail


def test_nesting_depth_is_counted_without_recursion() -> None:
    value: Any = []
    for _ in range(100_000):  # recursion would end at ~1000
        value = [value]
    assert nested_deeper_than(value)
    assert not nested_deeper_than({"a": [{"b": [1, 2]}]}, limit=4)
    assert nested_deeper_than({"a": [{"b": [1, 2]}]}, limit=3)


class ExplodingTokenizer:
    """A renderer that fails on one conversation with an error no check names."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.vocab_size = real.vocab_size
        self.bos_id = real.bos_id

    def chat_samples(self, messages: Any, tools: Any, expand: bool) -> Any:
        if messages[0]["content"] == "boom":
            raise KeyError("no such thing")
        return self.real.chat_samples(messages, tools, expand)


@pytest.mark.parametrize("expand", [False, True])
def test_any_error_while_judging_a_row_quarantines_that_row_alone(tokenizer: Any, expand: bool) -> None:
    boom = {"id": "b", "messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "a"},
                                    {"role": "user", "content": "again"}, {"role": "assistant", "content": "b"}]}
    got = list(read_samples(lines(GOOD, boom, GOOD), ExplodingTokenizer(tokenizer), 512, expand=expand))
    rejected = [g for g in got if isinstance(g, Rejected)]
    # Expanded, the row holds two samples (two assistant turns): both are set aside, indices kept.
    assert [g.index for g in got] == ([0, 1, 2, 3] if expand else [0, 1, 2])
    assert len(rejected) == (2 if expand else 1)
    assert all(r.reason == Reason.ROW_CHECK_FAILED and "KeyError" in r.detail for r in rejected), rejected
    assert isinstance(got[0], Prepared) and isinstance(got[-1], Prepared)
