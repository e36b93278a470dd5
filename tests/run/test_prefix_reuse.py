"""Prefix renders reuse the whole conversation's tokens (tokens.ChatTokenizer._reuse_prefix): the same
samples, masks and refusals as encoding every render in full, for every family of test_templates
(DeepSeek's real 128k tokenizer included), random conversations, tool calls, special-token text in
content (kept as text or allowed), templates that are not prefix-stable, and long multi-turn rows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from bench.tokenize import conversations as long_rows
from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import RowRefused
from hsx_extractor.run.tokens import ChatTokenizer
from tests.run.test_templates import ALL, TOOLS, Family, families, tool_chat
from tests.run.test_templates import conversations as random_conversations

__all__ = ["families"]  # the session fixture, shared with test_templates


@contextmanager
def reuse(tok: ChatTokenizer, on: bool) -> Iterator[None]:
    was = tok._reuse
    tok._reuse = on
    try:
        yield
    finally:
        tok._reuse = was


def outcome(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: Any, expand: bool) -> list[Any]:
    out: list[Any] = []
    for s in tok.chat_samples(messages, tools, expand):
        out.append((s.reason, s.detail) if isinstance(s, RowRefused) else (s[0].tolist(), s[1].tolist()))
    return out


def same_both_ways(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: Any = None) -> list[Any]:
    got = []
    for expand in (False, True):
        with reuse(tok, True):
            fast = outcome(tok, messages, tools, expand)
        with reuse(tok, False):
            slow = outcome(tok, messages, tools, expand)
        assert fast == slow, (tok.path, expand)
        got.append(fast)
    return got


@pytest.fixture(scope="module")
def allowing(families: dict[str, Family]) -> dict[str, ChatTokenizer]:
    """Each family's tokenizer with special-token text in content taken as special tokens."""
    return {n: ChatTokenizer(f.tokenizer.path, f.tokenizer.chat_template, "allow") for n, f in families.items()}


@pytest.mark.parametrize("name", ALL)
def test_every_family_passes_the_probe(families: dict[str, Family], allowing: dict[str, ChatTokenizer], name: str) -> None:
    assert families[name].tokenizer._reuse and allowing[name]._reuse


@pytest.mark.parametrize("name", ALL)
def test_long_rows_reuse_tokens_and_come_out_the_same(
    families: dict[str, Family], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = families[name].tokenizer
    calls: list[bool] = []
    real = tok._reuse_prefix

    def spy(*args: Any) -> Any:
        got = real(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(tok, "_reuse_prefix", spy)
    for messages in long_rows(3, turns=6, words=60, seed=7):
        whole, per_turn = same_both_ways(tok, messages)
        if name == "qwen3":  # drops earlier turns' thinking: only expanded turns are samples
            assert whole[0][0] == Reason.TEMPLATE_NOT_PREFIX_STABLE
            assert len(per_turn) == 6 and all(isinstance(s[0], list) for s in per_turn)
        else:
            assert isinstance(whole[0][0], list) and sum(whole[0][1]) > 0
    assert calls and sum(calls) >= 0.9 * len(calls), f"reused {sum(calls)} of {len(calls)} prefix renders"


@pytest.mark.parametrize("name", ["llama31", "qwen3", "deepseek-v3-real"])
def test_tool_calls_come_out_the_same(families: dict[str, Family], name: str) -> None:
    same_both_ways(families[name].tokenizer, tool_chat({"city": "Oslo"} if name != "deepseek-v3-real" else '{"city": "Oslo"}',
                                                       "" if name == "qwen3" else None), TOOLS)  # fmt: skip


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=random_conversations())
def test_property_random_conversations_come_out_the_same(
    families: dict[str, Family], allowing: dict[str, ChatTokenizer], messages: list[dict[str, str]]
) -> None:
    for name in ALL:
        same_both_ways(families[name].tokenizer, messages)
        same_both_ways(allowing[name], messages)
