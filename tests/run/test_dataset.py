"""Rows -> samples or reasons, with the real tiny tokenizer and its real chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import Prepared, Rejected, parse_row, prepare, prepare_samples, read_samples
from hsx_extractor.run.plan import build_plan
from hsx_extractor.run.sources import iter_rows
from hsx_extractor.run.tokens import ChatTokenizer, TokenizerError
from hsx_extractor.tools.cli import main
from hsx_extractor.tools.tinymodel import BOS, CHAT_TEMPLATE, EOS, TURN_END, example_dataset_path

STOCK_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def mask_runs(tokenizer: ChatTokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The masked runs of a sample, each decoded."""
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer._tok.decode(current))
            current = []
    if current:
        runs.append(tokenizer._tok.decode(current))
    return runs


def chat(*turns: tuple[str, Any]) -> bytes:
    return json.dumps({"id": "x", "messages": [{"role": r, "content": c} for r, c in turns]}).encode()


def outcome(
    raw: bytes, tokenizer: ChatTokenizer, max_length: int = 512, fmt: Any = "auto"
) -> Prepared | Rejected:
    row = parse_row(7, raw, fmt)
    return row if isinstance(row, Rejected) else prepare(row, tokenizer, max_length)


def reason_of(raw: bytes, tokenizer: ChatTokenizer, **kw: Any) -> str:
    got = outcome(raw, tokenizer, **kw)
    assert isinstance(got, Rejected), f"expected a rejection, got {got}"
    assert got.index == 7 and got.detail
    return str(got.reason)


GOOD = chat(("user", "What is the capital of Peru?"), ("assistant", "The capital of Peru is Lima."))


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"id": "a", "messages": [', Reason.INVALID_JSON),
        (b'{"id": "a", "messages": [{"role": "user", "content": "caf\xe9"}]}', Reason.INVALID_UTF8),
        (b"[1, 2, 3]", Reason.INVALID_ROW),
        (b'{"id": {"nested": 1}, "messages": []}', Reason.INVALID_ROW),
        (b'{"id": "a"}', Reason.INVALID_ROW),
        (json.dumps({"id": "a", "messages": []}).encode(), Reason.EMPTY_MESSAGES),
        (chat(("wizard", "hi"), ("assistant", "no")), Reason.UNKNOWN_ROLE),
        (json.dumps({"id": "a", "messages": [{"content": "hi"}]}).encode(), Reason.MISSING_ROLE),
        (chat(("user", ["not", "text"]), ("assistant", "x")), Reason.NON_STRING_CONTENT),
        (chat(("user", None), ("assistant", "x")), Reason.NON_STRING_CONTENT),
        (chat(("user", "Is anyone there?")), Reason.NO_ASSISTANT_TOKENS),
        (
            json.dumps({"id": "a", "input_ids": [1, 2, 99999], "loss_mask": [0, 1, 1]}).encode(),
            Reason.IDS_OUT_OF_VOCAB,
        ),
        (
            json.dumps({"id": "a", "input_ids": [1, 2, -1], "loss_mask": [0, 1, 1]}).encode(),
            Reason.IDS_OUT_OF_VOCAB,
        ),
        (
            json.dumps({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1]}).encode(),
            Reason.MASK_LENGTH_MISMATCH,
        ),
        (
            json.dumps({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}).encode(),
            Reason.NO_ASSISTANT_TOKENS,
        ),
        (json.dumps({"id": "a", "input_ids": [1, 2.5], "loss_mask": [0, 1]}).encode(), Reason.INVALID_ROW),
        (json.dumps({"id": "a", "input_ids": [1, 2], "loss_mask": [0, 2]}).encode(), Reason.INVALID_ROW),
        (json.dumps({"id": "a", "input_ids": [1, True], "loss_mask": [0, 1]}).encode(), Reason.INVALID_ROW),
        (json.dumps({"id": "a", "input_ids": [1, 2], "loss_mask": [False, True]}).encode(), Reason.INVALID_ROW),
        (json.dumps({"id": "a", "input_ids": [1, 2**70], "loss_mask": [0, 1]}).encode(), Reason.IDS_OUT_OF_VOCAB),
    ],
)
def test_each_bad_row_gets_its_reason(raw: bytes, reason: Reason, tokenizer: ChatTokenizer) -> None:
    assert reason_of(raw, tokenizer) == reason


def test_too_long_is_quarantined_never_truncated(tokenizer: ChatTokenizer) -> None:
    ok = outcome(GOOD, tokenizer)
    assert isinstance(ok, Prepared)
    assert reason_of(GOOD, tokenizer, max_length=ok.length - 1) == Reason.TOO_LONG
    exact = outcome(GOOD, tokenizer, max_length=ok.length)
    assert isinstance(exact, Prepared) and exact.length == ok.length
    tokens = json.dumps({"id": "t", "input_ids": [1] + [5] * 9, "loss_mask": [1] * 10}).encode()
    assert reason_of(tokens, tokenizer, max_length=9) == Reason.TOO_LONG


def test_format_restricts_row_kinds(tokenizer: ChatTokenizer) -> None:
    tokens = json.dumps({"id": "t", "input_ids": [1, 6], "loss_mask": [0, 1]}).encode()
    assert isinstance(outcome(tokens, tokenizer, fmt="tokens"), Prepared)
    assert reason_of(tokens, tokenizer, fmt="messages") == Reason.INVALID_ROW
    assert reason_of(GOOD, tokenizer, fmt="tokens") == Reason.INVALID_ROW


def test_template_error_is_a_reason(tiny_model: Path, tmp_path: Path) -> None:
    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}"
        + CHAT_TEMPLATE
    )
    tok = ChatTokenizer(tiny_model, strict)
    assert reason_of(chat(("assistant", "hi"), ("user", "x")), tok) == Reason.TEMPLATE_ERROR
    assert isinstance(outcome(GOOD, tok), Prepared)


def test_loss_mask_is_exactly_the_assistant_turns(tokenizer: ChatTokenizer) -> None:
    raw = chat(
        ("system", "Be brief."),
        ("user", "What is 2 plus 2?"),
        ("assistant", "2 plus 2 is 4."),
        ("user", "And 3 times 3?"),
        ("assistant", "9."),
    )
    got = outcome(raw, tokenizer)
    assert isinstance(got, Prepared)
    assert got.input_ids.dtype == np.int32 and got.loss_mask.dtype == np.uint8
    tok = tokenizer._tok
    # Masked runs decode to exactly each assistant message plus its end-of-turn token.
    runs, current = [], []
    for token, m in zip(got.input_ids.tolist(), got.loss_mask.tolist(), strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    assert runs == [f"2 plus 2 is 4.{TURN_END}", f"9.{TURN_END}"]
    # BOS exactly once, first; the template wrote it, nothing added another.
    bos = tok.convert_tokens_to_ids(BOS)
    assert got.input_ids[0] == bos and int((got.input_ids == bos).sum()) == 1


def test_a_template_that_writes_bos_twice_is_a_configuration_error(tiny_model: Path) -> None:
    with pytest.raises(TokenizerError, match="BOS twice"):
        ChatTokenizer(tiny_model, "{{ bos_token }}" + CHAT_TEMPLATE)


def test_a_template_that_does_not_parse_is_a_configuration_error(tiny_model: Path) -> None:
    with pytest.raises(TokenizerError, match="does not parse"):
        ChatTokenizer(tiny_model, "{% for m in messages %}{{ m['content'] }}")


def test_a_stock_template_is_accepted_and_its_masks_match_the_generation_tags(tiny_model: Path) -> None:
    stock = ChatTokenizer(tiny_model, STOCK_TEMPLATE)
    tagged = ChatTokenizer(tiny_model)
    assert not stock.has_generation and tagged.has_generation
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "2 plus 2 is 4."},
        {"role": "user", "content": "And 3 times 3?"},
        {"role": "assistant", "content": "9."},
        {"role": "user", "content": "Thanks."},
    ]
    ids, mask = stock.render(messages)
    want_ids, want_mask = tagged.render(messages)
    assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
    assert mask_runs(stock, ids, mask) == [f"2 plus 2 is 4.{TURN_END}", f"9.{TURN_END}"]


def test_fingerprint_covers_files_template_and_is_printed(
    tiny_model: Path, tmp_path: Path, capsys: Any
) -> None:
    a = ChatTokenizer(tiny_model).fingerprint
    assert len(a) == 64 and int(a, 16) >= 0
    assert ChatTokenizer(tiny_model).fingerprint == a
    assert ChatTokenizer(tiny_model, CHAT_TEMPLATE + " ").fingerprint != a
    copy = tmp_path / "tok"
    shutil.copytree(tiny_model, copy)
    assert ChatTokenizer(copy).fingerprint == a  # where it lives does not matter, what it holds does
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|end|>"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTokenizer(copy).fingerprint != a
    assert main(["fingerprint", str(tiny_model)]) == 0
    assert capsys.readouterr().out.strip() == a


def test_duplicate_ids_first_accepted_wins(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    rows = [
        json.dumps({"id": "d", "messages": []}),  # rejected: does not claim the id
        GOOD.decode().replace('"x"', '"d"'),
        GOOD.decode().replace('"x"', '"d"'),
        GOOD.decode().replace('"x"', '"e"'),
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(rows) + "\n\n")
    items = list(read_samples(iter_rows(str(path)), tokenizer, 512))
    assert len(items) == 4  # the trailing blank line is not a row
    plan = build_plan(
        {},
        [i.length if isinstance(i, Prepared) else None for i in items],
        [i.sample_id if isinstance(i, Prepared) else None for i in items],
        3,
        64,
        1 << 20,
    )
    assert plan.duplicates == {2}


def test_bundled_dataset_has_every_dataset_reason(tokenizer: ChatTokenizer) -> None:
    items = list(read_samples(iter_rows(str(example_dataset_path())), tokenizer, 256))
    reasons = {str(i.reason) for i in items if isinstance(i, Rejected)}
    assert reasons == {
        "invalid_json",
        "invalid_utf8",
        "empty_messages",
        "unknown_role",
        "missing_role",
        "non_string_content",
        "ids_out_of_vocab",
        "mask_length_mismatch",
        "no_assistant_tokens",
        "too_long",
    }
    assert sum(isinstance(i, Prepared) for i in items) >= 30


def test_missing_dataset_is_a_clear_error(tmp_path: Path) -> None:
    from hsx_extractor.run.sources import DatasetError

    with pytest.raises(DatasetError, match="does not exist"):
        list(iter_rows(str(tmp_path / "nope.jsonl")))


# ---- every per-row failure is a quarantine with its line ------------------------------------------


def test_a_lone_surrogate_is_a_quarantine_not_a_crash(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    raw = b'{"id": "s", "messages": [{"role": "user", "content": "x\\ud800y"}, {"role": "assistant", "content": "ok"}]}'
    got = outcome(raw, tokenizer)
    assert isinstance(got, Rejected) and got.reason == Reason.INVALID_UTF8 and "surrogate" in got.detail
    pair = b'{"id": "p", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}, {"role": "assistant", "content": "ok"}]}'
    assert isinstance(outcome(pair, tokenizer), Prepared)  # a valid pair is one character
    path = tmp_path / "s.jsonl"
    path.write_bytes(GOOD + b"\n" + raw + b"\n" + GOOD.replace(b'"x"', b'"y"') + b"\n")
    items = list(read_samples(iter_rows(str(path)), tokenizer, 512))
    assert [type(i).__name__ for i in items] == ["Prepared", "Rejected", "Prepared"]


def test_quarantines_carry_the_file_line_counting_blank_lines(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    path = tmp_path / "lines.jsonl"
    path.write_bytes(b"\n".join([GOOD, b"", b"   ", b"{broken", GOOD.replace(b'"x"', b'"z"'), b"", b"[1]"]) + b"\n")
    items = list(read_samples(iter_rows(str(path)), tokenizer, 512))
    assert [(i.index, i.line, type(i).__name__) for i in items] == [
        (0, 1, "Prepared"),
        (1, 4, "Rejected"),
        (2, 5, "Prepared"),
        (3, 7, "Rejected"),
    ]


def test_bos_text_in_a_system_prompt_stays_text(tokenizer: ChatTokenizer) -> None:
    raw = chat(("system", f"{BOS}You are terse."), ("user", "Hi"), ("assistant", "Hello."))
    got = outcome(raw, tokenizer)
    assert isinstance(got, Prepared)
    bos = tokenizer.bos_id
    assert bos is not None and got.input_ids[0] == bos and int((got.input_ids == bos).sum()) == 1
    assert BOS in tokenizer._tok.decode(got.input_ids[1:].tolist())


def test_special_token_text_in_content_never_becomes_a_special_id(tokenizer: ChatTokenizer) -> None:
    end = tokenizer.control[TURN_END]
    eos = tokenizer.control[EOS]
    raw = chat(("user", f"say {EOS} then {TURN_END}"), ("assistant", f"I say {TURN_END} and {EOS} as text."))
    got = outcome(raw, tokenizer)
    assert isinstance(got, Prepared)
    ids = got.input_ids.tolist()
    assert eos not in ids and ids.count(end) == 2  # the template's two turn ends, nothing else
    assert mask_runs(tokenizer, got.input_ids, got.loss_mask) == [f"I say {TURN_END} and {EOS} as text.{TURN_END}"]


def test_special_tokens_in_content_modes(tiny_model: Path) -> None:
    raw = chat(("system", f"{BOS}Be terse."), ("user", "Hi"), ("assistant", f"Hello{TURN_END}"))
    allow = ChatTokenizer(tiny_model, special_tokens_in_content="allow")
    quarantine = ChatTokenizer(tiny_model, special_tokens_in_content="quarantine")
    assert reason_of(raw, allow) == Reason.BOS_MISMATCH  # BOS twice once content may hold specials
    assert reason_of(raw, quarantine) == Reason.SPECIAL_TOKENS_IN_CONTENT
    allowed = outcome(chat(("user", "Hi"), ("assistant", f"Hello{TURN_END}")), allow)
    assert isinstance(allowed, Prepared) and allowed.input_ids.tolist().count(allow.control[TURN_END]) == 3
    assert isinstance(outcome(GOOD, quarantine), Prepared)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (
            json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}], "input_ids": [1, 5], "loss_mask": [0, 1]}).encode(),
            Reason.AMBIGUOUS_ROW,
        ),
        (
            json.dumps({"id": "a", "messages": [], "conversations": []}).encode(),
            Reason.AMBIGUOUS_ROW,
        ),
        (json.dumps({"id": "a", "input_ids": [40, 41, 42], "loss_mask": [0, 1, 1]}).encode(), Reason.BOS_MISMATCH),
        (json.dumps({"id": "a", "input_ids": [1, 1, 42], "loss_mask": [0, 1, 1]}).encode(), Reason.BOS_MISMATCH),
        (chat(("user", "Hi"), ("assistant", "")), Reason.EMPTY_ASSISTANT_TURN),
        (chat(("user", "Hi"), ("assistant", "  \n")), Reason.EMPTY_ASSISTANT_TURN),
        (chat(("user", "Hi"), ("assistant", "Yes."), ("user", "Sure?"), ("assistant", "")), Reason.EMPTY_ASSISTANT_TURN),
        # Shapes that raised TypeError or RecursionError before they could be judged.
        (json.dumps({"messages": [{"role": ["user"], "content": "x"}]}).encode(), Reason.UNKNOWN_ROLE),
        (json.dumps({"conversations": [{"from": {"a": 1}, "value": "x"}]}).encode(), Reason.UNKNOWN_ROLE),
        (b'{"id": "deep", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", Reason.INVALID_JSON),
    ],
)
def test_rows_that_must_not_be_written(raw: bytes, reason: Reason, tokenizer: ChatTokenizer) -> None:
    assert reason_of(raw, tokenizer) == reason


def test_pre_tokenized_rows_with_the_templates_bos_are_taken(tokenizer: ChatTokenizer) -> None:
    raw = json.dumps({"id": "t", "input_ids": [1, 41, 42], "loss_mask": [0, 1, 1]}).encode()
    assert isinstance(outcome(raw, tokenizer), Prepared)


def test_sharegpt_conversations_render_like_messages(tokenizer: ChatTokenizer) -> None:
    share = json.dumps({
        "id": "x",
        "system": "Be brief.",
        "conversations": [{"from": "human", "value": "What is 2 plus 2?"}, {"from": "gpt", "value": "4."}],
    }).encode()
    plain = chat(("system", "Be brief."), ("user", "What is 2 plus 2?"), ("assistant", "4."))
    a, b = outcome(share, tokenizer), outcome(plain, tokenizer)
    assert isinstance(a, Prepared) and isinstance(b, Prepared)
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    assert reason_of(json.dumps({"conversations": [{"from": "bard", "value": "x"}]}).encode(), tokenizer) == Reason.UNKNOWN_ROLE
    assert reason_of(json.dumps({"conversations": [{"value": "x"}]}).encode(), tokenizer) == Reason.MISSING_ROLE
    assert reason_of(json.dumps({"conversations": [{"from": "gpt", "value": 3}]}).encode(), tokenizer) == Reason.NON_STRING_CONTENT


# A stock template that, like reasoning templates, renders earlier assistant turns otherwise than
# the last one (here it keeps only the text after "Answer:" of earlier turns).
DROPPING = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and not loop.last and 'Answer:' in m['content'] %}"
    "{{ m['content'].split('Answer:')[-1] }}{% else %}{{ m['content'] }}{% endif %}{{ '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_quarantined_or_expanded(tiny_model: Path) -> None:
    tok = ChatTokenizer(tiny_model, DROPPING)
    row = chat(
        ("user", "2 plus 2?"), ("assistant", "Think: two and two. Answer: 4."), ("user", "3 plus 3?"), ("assistant", "6.")
    )
    assert reason_of(row, tok) == Reason.TEMPLATE_NOT_PREFIX_STABLE
    parsed = parse_row(0, row, line=3)
    assert not isinstance(parsed, Rejected)
    samples = prepare_samples(parsed, tok, 512, expand=True)
    assert [s.index for s in samples] == [0, 1] and [s.sample_id for s in samples] == ["x/turn1", "x/turn2"]
    first, second = samples
    assert isinstance(first, Prepared) and isinstance(second, Prepared) and first.line == second.line == 3
    assert mask_runs(tok, first.input_ids, first.loss_mask) == [f"Think: two and two. Answer: 4.{TURN_END}"]
    assert mask_runs(tok, second.input_ids, second.loss_mask) == [f"6.{TURN_END}"]
    assert " 4." in tok._tok.decode(second.input_ids.tolist()) and "Think" not in tok._tok.decode(second.input_ids.tolist())


def test_expanded_rows_take_one_index_per_turn(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    two = chat(("user", "a?"), ("assistant", "A."), ("user", "b?"), ("assistant", "B."))
    path = tmp_path / "e.jsonl"
    path.write_bytes(b"\n".join([two, b"{bad", GOOD, chat(("user", "only a question"))]) + b"\n")
    items = list(read_samples(iter_rows(str(path)), tokenizer, 512, expand=True))
    assert [(i.index, i.line, type(i).__name__) for i in items] == [
        (0, 1, "Prepared"), (1, 1, "Prepared"), (2, 2, "Rejected"), (3, 3, "Prepared"), (4, 4, "Rejected")
    ]
    wanted = list(read_samples(iter_rows(str(path)), tokenizer, 512, expand=True, wanted=lambda i: i == 3))
    assert [i.index for i in wanted] == [3]


def test_no_chat_template_is_a_configuration_error(tiny_model: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (bare / extra).unlink(missing_ok=True)
    tok = ChatTokenizer(bare)
    assert tok.chat_template is None
    tokens = json.dumps({"id": "t", "input_ids": [5, 6], "loss_mask": [0, 1]}).encode()
    assert isinstance(outcome(tokens, tok), Prepared)  # the tokenizer adds no BOS: none is required
    with pytest.raises(TokenizerError, match="no chat template"):
        outcome(GOOD, tok)


def test_deeply_nested_rows_are_judged_not_crashed(tokenizer: ChatTokenizer) -> None:
    deep = b"[" * 900 + b"]" * 900
    good = b'[{"role": "user", "content": "\\u00e9"}, {"role": "assistant", "content": "ok"}]'
    for raw in (
        b'{"id": "a", "tools": ' + deep + b', "messages": ' + good + b"}",
        b'{"id": "b", "messages": ' + good[:-1] + b', {"role": "user", "content": "x", "name": ' + deep + b"}]}",
    ):
        assert isinstance(outcome(raw, tokenizer), Rejected)


def test_a_huge_row_is_refused_before_it_is_parsed(tokenizer: ChatTokenizer) -> None:
    import tracemalloc

    from hsx_extractor.run.row_bounds import row_bytes_limit
    from hsx_extractor.run.sources import SourceRow

    text = "word " * 6_600_000  # a 33 MB row: parsing and tokenizing it took GiBs
    huge = json.dumps({"id": "huge", "messages": [{"role": "user", "content": text},
                                                  {"role": "assistant", "content": "ok"}]}).encode()  # fmt: skip
    tracemalloc.start()
    try:
        (got,) = read_samples([SourceRow(3, huge)], tokenizer, max_length=512)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(got, Rejected) and got.reason == Reason.TOO_LONG and got.line == 3
    assert f"row is {len(huge)} bytes" in got.detail and "not parsed" in got.detail
    assert peak < len(huge) // 4  # nothing the size of the row was built
    # Up to the limit a row is parsed and judged by its tokens.
    padded = json.dumps({"id": "p", "messages": json.loads(GOOD)["messages"], "pad": "x" * 4000}).encode()
    assert len(padded) < row_bytes_limit(512)
    (kept,) = read_samples([SourceRow(4, padded)], tokenizer, max_length=512)
    assert isinstance(kept, Prepared)


def test_a_long_sample_id_is_a_bad_row_not_a_huge_shard_header(tokenizer: ChatTokenizer) -> None:
    from hsx_extractor.run.dataset import MAX_ID_CHARS

    messages = json.loads(GOOD)["messages"]
    long_id = json.dumps({"id": "i" * 8_000_000, "messages": messages}).encode()
    assert reason_of(long_id, tokenizer) == Reason.INVALID_ROW
    longest = json.dumps({"id": "i" * MAX_ID_CHARS, "messages": messages}).encode()
    assert isinstance(outcome(longest, tokenizer), Prepared)


def test_out_of_vocab_detail_counts_and_names_the_first(tokenizer: ChatTokenizer) -> None:
    vocab = tokenizer.vocab_size
    raw = json.dumps({"id": "a", "input_ids": [1, vocab + 5, -3, vocab], "loss_mask": [0, 1, 1, 1]}).encode()
    rejected = outcome(raw, tokenizer)
    assert isinstance(rejected, Rejected) and rejected.detail == f"3 ids outside [0, {vocab}), first {vocab + 5}"
