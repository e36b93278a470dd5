"""Rows -> samples or reasons, with the real tiny tokenizer and its real chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.reasons import Reason
from hsx_extractor.run.dataset import Prepared, Rejected, iter_lines, parse_row, prepare, read_samples
from hsx_extractor.run.plan import build_plan
from hsx_extractor.run.tokens import ChatTokenizer, TokenizerError
from hsx_extractor.tools.cli import main
from hsx_extractor.tools.tinymodel import BOS, CHAT_TEMPLATE, TURN_END, example_dataset_path


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
    tokens = json.dumps({"id": "t", "input_ids": [5] * 10, "loss_mask": [1] * 10}).encode()
    assert reason_of(tokens, tokenizer, max_length=9) == Reason.TOO_LONG


def test_format_restricts_row_kinds(tokenizer: ChatTokenizer) -> None:
    tokens = json.dumps({"id": "t", "input_ids": [5, 6], "loss_mask": [0, 1]}).encode()
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


def test_double_bos_is_refused(tiny_model: Path) -> None:
    tok = ChatTokenizer(tiny_model, "{{ bos_token }}" + CHAT_TEMPLATE)
    with pytest.raises(TokenizerError, match="BOS twice"):
        tok.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])


def test_template_without_generation_is_refused(tiny_model: Path) -> None:
    tok = ChatTokenizer(
        tiny_model, CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    )
    with pytest.raises(TokenizerError, match="generation"):
        tok.require_generation_template()


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
    items = list(read_samples(iter_lines(str(path)), tokenizer, 512))
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
    items = list(read_samples(iter_lines(str(example_dataset_path())), tokenizer, 256))
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
    from hsx_extractor.run.dataset import DatasetError

    with pytest.raises(DatasetError, match="does not exist"):
        list(iter_lines(str(tmp_path / "nope.jsonl")))
