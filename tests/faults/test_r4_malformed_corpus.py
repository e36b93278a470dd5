"""R4: a corpus of 50+ malformed and tricky rows among good ones, each with its expected outcome.
Each bad row ends in its own, asserted quarantine reason with its file line, in the shard commit
records and the manifest (with a detail), and the counts show in /progress and /metrics; good and
tricky-but-valid rows are all extracted and nothing is lost. The template is a stock one (no
{% generation %}): masks come from prefix renders."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hsx_extractor.config import ExtractConfig
from hsx_extractor.reasons import GENERATION_REASONS, Reason
from hsx_extractor.run.extraction import Extraction
from hsx_extractor.run.progress import Progress, bound_port, start_progress_server
from hsx_extractor.tools.demo import reference_server
from hsx_extractor.tools.tinymodel import BOS, EOS, TURN_END
from hsx_extractor.tools.verify import run_verify
from tests.faults.helpers import stored
from tests.run.helpers import chat_rows

pytestmark = pytest.mark.slow
MAX_LENGTH = 256
# A stock template (no {% generation %}) that refuses one content on purpose, so template_error is
# reachable from data alone, and that renders an earlier assistant turn holding "Answer:" by its
# answer only, as reasoning templates drop earlier thinking: template_not_prefix_stable from data.
REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'FORBIDDEN' %}"
    "{{ raise_exception('this template refuses FORBIDDEN') }}{% endif %}{% endfor %}"
    "{{ bos_token }}{% for m in messages %}{{ '<|start|>' + m['role'] + '\\n' }}"
    "{% set text = m['content'] if m['content'] is string else '' %}"
    "{% if m['role'] == 'assistant' and not loop.last and 'Answer:' in text %}"
    "{{ text.split('Answer:')[-1] }}{% else %}{{ text }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}{{ '[call ' + c['function']['name'] + ']' }}{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)


def chat(sample_id: Any, *turns: tuple[str, Any]) -> bytes:
    return json.dumps({"id": sample_id, "messages": [{"role": r, "content": c} for r, c in turns]}).encode()


def tokens(sample_id: str, ids: Any, mask: Any) -> bytes:
    return json.dumps({"id": sample_id, "input_ids": ids, "loss_mask": mask}).encode()


QA = (("user", "What is two plus two?"), ("assistant", "Four."))
# (raw line, reason): each a different way to be wrong.
MALFORMED: list[tuple[bytes, Reason]] = [
    (b'{"id": "j1", "messages": [', Reason.INVALID_JSON),
    (b'{"id": ', Reason.INVALID_JSON),
    (b"not json at all", Reason.INVALID_JSON),
    (b'{"id": "j4", "messages": []}}', Reason.INVALID_JSON),
    (b'\xef\xbb\xbf{"id": "j5", "messages": []}', Reason.INVALID_JSON),  # a UTF-8 BOM before the JSON
    (b'{"id": "u1", "messages": [{"role": "user", "content": "caf\xe9"}]}', Reason.INVALID_UTF8),
    (b"\xff\xfe{}", Reason.INVALID_UTF8),
    # A lone surrogate escape: valid JSON, no UTF-8 form (a TypeError in the planning pass before).
    (b'{"id": "u3", "messages": [{"role": "user", "content": "x\\ud800"}, {"role": "assistant", "content": "y"}]}',
     Reason.INVALID_UTF8),
    (b'{"id": "u4", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\udfff"}]}',
     Reason.INVALID_UTF8),
    (b"[1, 2, 3]", Reason.INVALID_ROW),
    (b'"just a string"', Reason.INVALID_ROW),
    (b'{"id": {"nested": 1}, "messages": []}', Reason.INVALID_ROW),
    (b'{"id": true, "messages": []}', Reason.INVALID_ROW),
    (b'{"id": "nothing"}', Reason.INVALID_ROW),
    (b'{"id": "m1", "messages": "not a list"}', Reason.INVALID_ROW),
    (b'{"id": "m2", "messages": [42]}', Reason.INVALID_ROW),
    (tokens("t1", ["a", "b"], [0, 1]), Reason.INVALID_ROW),
    (tokens("t2", [1, 2], [0, 2]), Reason.INVALID_ROW),
    (json.dumps({"id": "t3", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                 "tools": "not a list"}).encode(), Reason.INVALID_ROW),
    (json.dumps({"id": "t4", "messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
                                          {"role": "assistant", "content": "y"}]}).encode(), Reason.INVALID_ROW),
    (json.dumps({"id": "a1", "messages": [dict(zip(("role", "content"), QA[0], strict=True))],
                 "input_ids": [1, 5], "loss_mask": [0, 1]}).encode(), Reason.AMBIGUOUS_ROW),
    (json.dumps({"id": "a2", "messages": [{"role": "user", "content": "x"}],
                 "conversations": [{"from": "human", "value": "x"}]}).encode(), Reason.AMBIGUOUS_ROW),
    (b'{"id": "e1", "messages": []}', Reason.EMPTY_MESSAGES),
    (b'{"id": 77, "messages": []}', Reason.EMPTY_MESSAGES),
    (chat("r1", ("wizard", "hi"), ("assistant", "no")), Reason.UNKNOWN_ROLE),
    (chat("r2", ("User", "hi"), ("assistant", "no")), Reason.UNKNOWN_ROLE),
    (json.dumps({"id": "r5", "conversations": [{"from": "bard", "value": "hi"}]}).encode(), Reason.UNKNOWN_ROLE),
    (b'{"id": "r3", "messages": [{"content": "hi"}]}', Reason.MISSING_ROLE),
    (b'{"id": "r4", "messages": [{"role": "user", "content": "a"}, {"content": "b"}]}', Reason.MISSING_ROLE),
    (json.dumps({"id": "r6", "conversations": [{"value": "hi"}]}).encode(), Reason.MISSING_ROLE),
    (chat("c1", ("user", ["not", "text"]), ("assistant", "x")), Reason.NON_STRING_CONTENT),
    (chat("c2", ("user", None), ("assistant", "x")), Reason.NON_STRING_CONTENT),
    (chat("c3", ("user", "fine"), ("assistant", 42)), Reason.NON_STRING_CONTENT),
    (chat("y1", ("user", "Hi"), ("assistant", "")), Reason.EMPTY_ASSISTANT_TURN),
    (chat("y2", ("user", "Hi"), ("assistant", "Yes."), ("user", "More?"), ("assistant", " \n ")),
     Reason.EMPTY_ASSISTANT_TURN),
    (chat("x1", ("user", "FORBIDDEN"), ("assistant", "x")), Reason.TEMPLATE_ERROR),
    (chat("x2", ("user", "ok"), ("assistant", "FORBIDDEN")), Reason.TEMPLATE_ERROR),
    (chat("p1", ("user", "2+2?"), ("assistant", "Two and two. Answer: 4."), ("user", "3+3?"), ("assistant", "6.")),
     Reason.TEMPLATE_NOT_PREFIX_STABLE),
    (tokens("b1", [40, 41, 42], [0, 1, 1]), Reason.BOS_MISMATCH),  # pre-tokenized without the template's BOS
    (tokens("b2", [1, 1, 42], [0, 1, 1]), Reason.BOS_MISMATCH),
    (tokens("v1", [1, 2, 99999], [0, 1, 1]), Reason.IDS_OUT_OF_VOCAB),
    (tokens("v2", [-1, 3], [0, 1]), Reason.IDS_OUT_OF_VOCAB),
    (tokens("k1", [1, 2, 3], [0, 1]), Reason.MASK_LENGTH_MISMATCH),
    (tokens("k2", [1], [1, 1, 1]), Reason.MASK_LENGTH_MISMATCH),
    (chat("n1", ("user", "Is anyone there?")), Reason.NO_ASSISTANT_TOKENS),
    (tokens("n2", [1, 6, 7], [0, 0, 0]), Reason.NO_ASSISTANT_TOKENS),
    (chat("l1", ("user", "word " * 400), ("assistant", "ok")), Reason.TOO_LONG),
    (tokens("l2", [1] + [5] * MAX_LENGTH, [0] + [1] * MAX_LENGTH), Reason.TOO_LONG),
    (chat("g0", *QA), Reason.DUPLICATE_ID),
    (tokens("g1", [1, 6], [0, 1]), Reason.DUPLICATE_ID),
]
# Tricky rows that are valid: each must be written (the expected outcome is a sample).
TRICKY: list[bytes] = [
    chat("k-bos", ("system", f"{BOS}You are terse."), *QA),  # the BOS text in content stays text
    chat("k-special", ("user", f"Say {EOS} and {TURN_END}"), ("assistant", f"I say {TURN_END} and {EOS}.")),
    chat("k-emoji", ("user", "\ud83d\ude00 caf\u00e9 \u4e2d\u6587"), ("assistant", "\u00a1S\u00ed! \U0001f600")),
    json.dumps({"id": "k-sharegpt", "system": "Be brief.",
                "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}).encode(),
    json.dumps({"id": "k-tools", "tools": [{"type": "function", "function": {"name": "weather"}}], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "3 C", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 3 C."}]}).encode(),
    chat("k-trailing-user", *QA, ("user", "Thanks!")),
    chat(12345, *QA),  # an integer id
    tokens("k-tokens", [1, 40, 41, 42], [0, 0, 1, 1]),
    chat("k-crlf", *QA) + b"\r",  # a CRLF line ending
    b"   " + chat("k-indent", *QA),  # leading whitespace
    chat("k-answer-last", ("user", "2+2?"), ("assistant", "Two and two. Answer: 4.")),  # stable: it is the last turn
]
DATASET_REASONS = {r for r in Reason if r.value not in {"id_mismatch", "length_mismatch", "non_finite", "no_dump",
                                                          "server_error", "special_tokens_in_content",
                                                          "row_check_failed"}} - GENERATION_REASONS
# The generation reasons come from what the target generates (responses: regenerate), not from a row's bytes:
# tests/run/test_regenerate.py and tests/engines/test_regenerate_real.py cover them.
# special_tokens_in_content needs dataset.specialTokensInContent: quarantine (or a tokenizer that cannot keep
# such text as text); tests/run/test_dataset.py covers it. Here content specials are text (the TRICKY rows).
# row_check_failed is the net under every check (an error no check names): no row of data should reach it;
# tests/run/test_hostile_rows.py drives it with a failing renderer.


def corpus() -> tuple[bytes, dict[int, Reason], dict[int, int], int]:
    """Good rows ("g0", "g1", ...) with the malformed and tricky ones spread among them (and blank
    lines, which are not rows). Returns (file bytes, expected reason by row index, file line by row
    index, count of rows to be written)."""
    good = [json.dumps(r).encode() for r in chat_rows(24, words=8, prefix="g")] + TRICKY
    lines: list[bytes] = []
    expected: dict[int, Reason] = {}
    bad = iter(MALFORMED)
    for row in good:
        lines.append(row)
        for _ in range(2):
            item = next(bad, None)
            if item is not None:
                expected[len(lines)] = item[1]
                lines.append(item[0])
    for raw, reason in bad:
        expected[len(lines)] = reason
        lines.append(raw)
    line_of = {index: 2 * index + 1 for index in range(len(lines))}  # rows are separated by a blank line
    return b"\n\n".join(lines) + b"\n", expected, line_of, len(good)


def test_the_corpus_covers_every_dataset_reason() -> None:
    assert len(MALFORMED) + len(TRICKY) >= 40 and len(MALFORMED) >= 40
    assert {r for _, r in MALFORMED} == DATASET_REASONS


def test_each_malformed_row_gets_its_reason_everywhere(tmp_path: Path, fault_model: Path) -> None:
    data, expected, line_of, good = corpus()
    dataset = tmp_path / "corpus.jsonl"
    dataset.write_bytes(data)
    dumps = tmp_path / "dumps"
    with reference_server(fault_model, dumps, ["--threads", "1"]) as url:
        cfg = ExtractConfig.model_validate({
            "runId": "r4",
            "dataset": {"uri": str(dataset), "maxLength": MAX_LENGTH, "chatTemplate": REFUSING_TEMPLATE},
            "output": {"uri": str(tmp_path / "out"), "shardTargetBytes": 1 << 20},
            "modelPath": str(fault_model),
            "serverUrl": url,
            "dumpDir": str(dumps),
            "concurrency": 4,
            "progressPort": 0,
            "logIntervalSeconds": 60,
            # Mostly malformed on purpose: the rejection gate (tests/run/test_dataset_rejected.py) stays out.
            "validation": {"maxRejectedRowRate": 1.0},
        })

        async def scenario() -> tuple[Any, dict[str, Any], str]:
            progress = Progress(cfg.runId, 0)
            runner = await start_progress_server(progress, "127.0.0.1", 0)
            try:
                result = await Extraction(cfg, progress).run()
                base = f"http://127.0.0.1:{bound_port(runner)}"
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"{base}/progress") as r:
                        seen = await r.json()
                    async with http.get(f"{base}/metrics") as r:
                        metrics = await r.text()
            finally:
                await runner.cleanup()
            return result, seen, metrics

        result, seen, metrics = asyncio.run(scenario())
    counts = Counter(str(r) for r in expected.values())
    samples, quarantined = stored(cfg.output.model_dump(), "r4")
    assert quarantined == {i: str(r) for i, r in expected.items()}
    assert len(samples) == good and not set(samples) & set(expected)
    manifest = result.manifest
    assert manifest is not None and manifest["quarantined"] == len(expected) and manifest["samples"] == good
    assert {q["index"]: q["reason"] for q in manifest["quarantine"]} == quarantined
    assert {q["index"]: q["line"] for q in manifest["quarantine"]} == {i: line_of[i] for i in expected}
    assert all(q["detail"] for q in manifest["quarantine"])
    assert seen["state"] == "succeeded" and seen["samplesQuarantined"] == len(expected)
    assert seen["quarantinedByReason"] == dict(counts)
    assert seen["samplesDone"] == seen["samplesTotal"] == good + len(expected)
    for reason, n in counts.items():
        assert f'hsx_samples_quarantined_total{{reason="{reason}"}} {float(n)}' in metrics
    report = run_verify(str(tmp_path / "out" / "r4"))
    assert report.ok and report.quarantined == len(expected) and report.samples == good, report.summary_text()
