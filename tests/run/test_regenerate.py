"""responses: regenerate against the real reference server (which generates with transformers, seeded):
the pure parts, whole runs in both turn modes, the quarantine reasons, and kills during generation
and during capture resumed with no row generated twice and none lost."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest

from hsx_extractor.config import ExtractConfig, GenerationSpec
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT, EXIT_TRANSIENT
from hsx_extractor.reasons import GENERATION_REASONS, Reason
from hsx_extractor.run.dataset import Prepared, Rejected
from hsx_extractor.run.regenerate import Prompt, prompt_preparer, regenerated_turns, sample_of, stale
from hsx_extractor.run.server_client import (
    Sampling,
    sglang_generated,
    sglang_generation,
    vllm_generated,
    vllm_generation,
)
from hsx_extractor.run.tokens import ChatTokenizer
from hsx_extractor.storage import failpoints
from hsx_extractor.tools.tinymodel import TURN_END, TinyModelSpec, build_tiny_model
from tests.faults.helpers import RefServerProcess, free_port, hsx_verify, start_extract

from .helpers import RefServer, base_config, write_jsonl
from .test_pipeline import run, stored

SPEAKING = TinyModelSpec(spoken_words=12)


def rows(n: int) -> list[dict[str, Any]]:
    """Prompt-only rows, one-turn chats and two-turn chats, in turn."""
    out = []
    for i in range(n):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Question {i}: alpha beta gamma {i}?"}]
        if i % 3 >= 1:
            messages.append({"role": "assistant", "content": f"the dataset's answer {i}"})
        if i % 3 == 2:
            messages += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": f"then {i}"}]
        out.append({"id": f"r{i}", "messages": messages})
    return out


# ---- the pure parts ----------------------------------------------------------------------------
def test_which_turns_are_regenerated() -> None:
    user, tool = {"role": "user", "content": "q"}, {"role": "tool", "content": "42"}
    said = {"role": "assistant", "content": "a"}
    calls = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
    assert regenerated_turns([user], "last") == [1]  # a prompt-only row gets a new turn
    assert regenerated_turns([user, said], "last") == [1]
    assert regenerated_turns([user, said, user, said], "last") == [3]
    assert regenerated_turns([user, said, user, said], "each") == [1, 3]
    assert regenerated_turns([user, said, user], "each") == [1, 3]
    assert regenerated_turns([user, calls, tool], "each") == [3]  # the tool call is kept, a new answer follows
    assert regenerated_turns([user, calls], "last") == []  # nothing to regenerate after a call
    assert regenerated_turns([user, said, user, calls], "each") == [1]  # the earlier answer still is


def test_a_stored_generation_is_captured_only_as_this_rows_with_these_settings() -> None:
    user, said = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    ids = np.asarray([1, 2], dtype=np.int32)
    item = Prompt(3, "r3", ids, np.zeros_like(ids, dtype=np.uint8), 4, (user, said, user, said), None, (1, 3), 64, 8)
    mine = {"index": 3, "id": "r3", "plan": "p1", "turns": [],
            "messages": [user, {"role": "assistant", "content": "new"}, user, {"role": "assistant", "content": "new"}]}
    assert stale(mine, item, "p1") is None
    assert stale({k: v for k, v in mine.items() if k != "plan"}, item, "p1") is None  # stored before the digest was
    assert "does not hold it" in (stale(None, item, "p1") or "") and "does not hold it" in (stale({**mine, "id": "x"}, item, "p1") or "")
    assert "other settings" in (stale(mine, item, "p2") or "")
    edited = {**mine, "messages": [{"role": "user", "content": "edited"}, *mine["messages"][1:]]}
    assert "dataset turns changed" in (stale(edited, item, "p1") or "")
    assert "dataset turns changed" in (stale({**mine, "tools": [{"name": "f"}]}, item, "p1") or "")
    assert "dataset turns changed" in (stale({**mine, "messages": mine["messages"][:2]}, item, "p1") or "")


def test_settings_that_cannot_regenerate_are_refused() -> None:
    base = {"runId": "r", "output": {"uri": "/tmp/o"}, "responses": "regenerate"}
    for dataset, words in (({"format": "tokens"}, "no turns"), ({"expandTurns": True}, "expandTurns")):
        with pytest.raises(pydantic.ValidationError, match=words):
            ExtractConfig.model_validate({**base, "dataset": {"uri": "d.jsonl", **dataset}})
    vllm = {**base, "engine": "vllm", "dataset": {"uri": "d.jsonl"}}
    with pytest.raises(pydantic.ValidationError, match=r"needs generation\.temperature 0"):
        ExtractConfig.model_validate({**vllm, "generation": {"temperature": 0.7}})
    assert ExtractConfig.model_validate(vllm).generation.temperature == 0  # greedy: vLLM decodes it exactly
    with pytest.raises(pydantic.ValidationError, match="stop string"):
        GenerationSpec(stop=[""])


def test_generation_requests_and_answers_of_each_engine() -> None:
    sampling = Sampling(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=11, stop=("</a>",))
    body = sglang_generation([1, 2], sampling)
    assert "rid" not in body and "return_hidden_states" not in body  # no dump for a generation
    assert body["sampling_params"] == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stop": ["</a>"],
                                       "sampling_seed": 11, "skip_special_tokens": False, "no_stop_trim": True}
    answer = {"output_ids": [5, 6, 4], "meta_info": {"prompt_tokens": 2, "finish_reason": {"type": "stop", "matched": 4}}}
    assert sglang_generated(answer).ids == [5, 6, 4] and sglang_generated(answer).finish == "stop"
    body = vllm_generation([1, 2], sampling)
    assert "kv_transfer_params" not in body and body["seed"] == 11 and body["return_token_ids"] is True
    assert body["include_stop_str_in_output"] is True and body["max_tokens"] == 7
    answer = {"choices": [{"token_ids": [5, 6], "finish_reason": "length"}], "usage": {"prompt_tokens": 2}}
    assert vllm_generated(answer).finish == "length" and vllm_generated(answer).prompt_tokens == 2


@pytest.fixture(scope="module")
def speaking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("speaking") / "model", SPEAKING)


@pytest.fixture(scope="module")
def speaking_tokenizer(speaking_model: Path) -> ChatTokenizer:
    return ChatTokenizer(speaking_model)


def test_a_generation_becomes_the_sample_only_if_it_re_renders_to_its_ids(speaking_tokenizer: ChatTokenizer) -> None:
    tok = speaking_tokenizer
    end = tok.special_ids & {tok._tok.convert_tokens_to_ids(TURN_END)}
    messages = [{"role": "user", "content": "hello there"}]
    prompt = tok.encode_chat(messages, None, True).ids
    words = tok.encode_chat([{"role": "user", "content": " alpha beta"}], None, False).ids
    words = [i for i in words if i not in tok.special_ids][-2:]
    text = tok.decode(words)
    record = {"index": 0, "id": "a", "line": 1, "messages": [*messages, {"role": "assistant", "content": text}],
              "turns": [{"message": 1, "promptTokens": len(prompt), "outputIds": [*words, *end], "finish": "stop"}]}
    sample = sample_of(record, tok, 512)
    assert isinstance(sample, Prepared)
    assert sample.input_ids.tolist()[: len(prompt) + len(words)] == prompt + words
    assert sample.loss_mask[len(prompt) : len(prompt) + len(words) + 1].all()  # the text and its end of turn
    assert not sample.loss_mask[: len(prompt)].any()
    # The same text spelled in other tokens (one piece per character) re-renders to the canonical ones.
    pieces = [tok._tok.convert_tokens_to_ids(c) for c in tok._tok.convert_ids_to_tokens(words[0])]
    assert all(isinstance(p, int) and p != tok._tok.unk_token_id for p in pieces) and len(pieces) > 1
    odd = {**record, "turns": [{**record["turns"][0], "outputIds": [*pieces, *words[1:], *end]}]}
    refused = sample_of(odd, tok, 512)
    assert isinstance(refused, Rejected) and refused.reason == Reason.GENERATION_NOT_RERENDERABLE
    assert "from token" in refused.detail
    kept = sample_of({**record, "quarantine": {"reason": "empty_generation", "detail": "none"}}, tok, 512)
    assert isinstance(kept, Rejected) and kept.reason == Reason.EMPTY_GENERATION
    broken = sample_of({**record, "messages": None}, tok, 512)  # whatever judging raises sets the row aside
    assert isinstance(broken, Rejected) and broken.reason == Reason.ROW_CHECK_FAILED


def test_a_prompt_is_planned_at_its_bound_and_a_prompt_too_long_is_refused(speaking_tokenizer: ChatTokenizer) -> None:
    from hsx_extractor.run.dataset import MessagesRow

    prepare = prompt_preparer(GenerationSpec(maxNewTokens=100))
    row = MessagesRow(0, "a", [{"role": "user", "content": "q"}])
    (prompt,) = prepare(row, speaking_tokenizer, 512, False)
    assert isinstance(prompt, Prompt) and not prompt.loss_mask.any()
    assert prompt.length == len(prompt.input_ids) + 100 + 16  # the plan's size: the sample at its largest
    (capped,) = prepare(row, speaking_tokenizer, 64, False)
    assert isinstance(capped, Prompt) and capped.length == 64
    (refused,) = prepare(MessagesRow(1, "b", [{"role": "user", "content": "word " * 200}]), speaking_tokenizer, 64, False)
    assert isinstance(refused, Rejected) and refused.reason == Reason.TOO_LONG


# ---- whole runs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def speaker(speaking_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefServerProcess]:
    work = tmp_path_factory.mktemp("speaker")
    server = RefServerProcess(speaking_model, work / "dumps", free_port(), work / "server.log", "--enable-test-hooks")
    server.start()
    yield server
    server.stop()


def config(tmp: Path, server: RefServerProcess, dataset: Path, run_id: str, **generation: Any) -> dict[str, Any]:
    """base_config (1 MiB shards: a few rows each at the planned bound, prompt + maxNewTokens + 16 tokens) with
    its validation replaced by a longer dump wait, regenerating seeded."""
    settings = {"temperature": 1.0, "seed": 7, "maxNewTokens": 200, **generation}
    return base_config(tmp, server, dataset, run_id, validation={"dumpTimeoutSeconds": 10},  # type: ignore[arg-type]
                       responses="regenerate", generation=settings)  # fmt: skip


def generations(cfg: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every stored generation of a run by row index, each row in exactly one file."""
    found: dict[int, dict[str, Any]] = {}
    for path in sorted((Path(cfg["output"]["uri"]) / cfg["runId"] / "generations").glob("shard-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert record["index"] not in found
            found[record["index"]] = record
    return found


def check_captures(cfg: dict[str, Any], tok: ChatTokenizer, want_rows: int) -> dict[int, dict[str, Any]]:
    """Each row is written or quarantined once; each written sample is its stored generation rendered
    by the chat template, holding every turn's prompt ids then its generated ids."""
    samples, quarantined = stored(cfg)
    records = generations(cfg)
    assert sorted([*samples, *quarantined]) == list(range(want_rows)) == sorted(records)
    for index, reason in quarantined.items():
        assert records[index]["quarantine"]["reason"] == reason
    for index, sample in samples.items():
        record = records[index]
        assert "quarantine" not in record and sample.sample_id == record["id"]
        ids, mask = tok.render(record["messages"])
        assert sample.input_ids.tolist() == ids.tolist() and sample.loss_mask.tolist() == mask.tolist()
        for turn in record["turns"]:
            prompt = tok.encode_chat(record["messages"][: turn["message"]], None, True).ids
            generated = turn["outputIds"][:-1] if turn["finish"] == "stop" else turn["outputIds"]
            assert ids.tolist()[: len(prompt) + len(generated)] == prompt + generated, index
    return records


def test_regenerated_last_turns_are_captured_and_stored(
    tmp_path: Path, speaker: RefServerProcess, speaking_tokenizer: ChatTokenizer
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", rows(20))
    cfg = config(tmp_path, speaker, dataset, "last")
    before = speaker.stats()["generations"]
    code, result, progress = run(cfg)
    assert code == EXIT_OK and result is not None
    assert speaker.stats()["generations"] - before == 20  # one request per row: "last" generates one turn
    records = check_captures(cfg, speaking_tokenizer, 20)
    written = [r for r in records.values() if "quarantine" not in r]
    assert len(written) >= 10, records
    for i, record in records.items():  # the dataset's own answer is gone, its earlier turns kept
        original = rows(20)[i]["messages"]
        target = record["turns"][0]["message"]
        assert target == (len(original) - 1 if original[-1]["role"] == "assistant" else len(original))
        assert record["messages"][:target] == original[:target]
    report = progress.report()
    assert report.samplesGenerated == 20 and report.generationDecodeTokensPerSecond > 0
    assert set(report.quarantinedByReason) <= set(GENERATION_REASONS)
    manifest = result.manifest
    assert manifest is not None and manifest["run"]["responses"]["from"] == "regenerate"
    assert manifest["run"]["responses"]["generation"]["seed"] == 7
    assert hsx_verify(str(Path(cfg["output"]["uri"]) / "last"))["ok"]


def test_each_turn_regenerated_and_truncation_kept_or_quarantined(
    tmp_path: Path, speaker: RefServerProcess, speaking_tokenizer: ChatTokenizer
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", [r for r in rows(12) if len(r["messages"]) == 4])
    cfg = config(tmp_path, speaker, dataset, "each", turns="each", maxNewTokens=2, onTruncated="keep")
    assert run(cfg)[0] == EXIT_OK
    records = check_captures(cfg, speaking_tokenizer, 4)
    truncated = [r for r in records.values() if r["turns"][-1]["finish"] == "length" and "quarantine" not in r]
    assert truncated, records  # kept: the template closes the turn where the tokens ran out
    assert any(len(r["turns"]) == 2 for r in records.values())  # both turns generated, the second after the first
    # Quarantined, they count toward maxRejectedRowRate: a run of mostly truncated turns does not succeed.
    code, _, progress = run(config(tmp_path, speaker, dataset, "truncated", maxNewTokens=2))
    assert code == EXIT_PERMANENT and progress.failure_reason == "DatasetRejected", progress.last_error
    assert "truncated_generation" in (progress.last_error or "")
    cfg = config(tmp_path, speaker, dataset, "allowed", maxNewTokens=2)
    cfg["validation"]["maxRejectedRowRate"] = 1.0
    code, _, progress = run(cfg)
    assert code == EXIT_OK and progress.quarantined[Reason.TRUNCATED_GENERATION] >= 1
    check_captures(cfg, speaking_tokenizer, 4)


def test_other_generation_settings_do_not_resume_a_run(tmp_path: Path, speaker: RefServerProcess) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", rows(3))
    assert run(config(tmp_path, speaker, dataset, "fixed"))[0] == EXIT_OK
    code, _, progress = run(config(tmp_path, speaker, dataset, "fixed", temperature=0.5))
    assert code == EXIT_PERMANENT and "regenerate" in (progress.last_error or ""), progress.last_error


def test_generations_left_by_a_run_restarted_with_other_settings_or_rows_are_refused(
    tmp_path: Path, speaker: RefServerProcess
) -> None:
    """Killed once its generations were stored but before plan.json and any commit (only they are left), a run
    restarted with other settings or an edited row stops rather than capture what it did not generate."""
    dataset = write_jsonl(tmp_path / "d.jsonl", rows(6))
    cfg = config(tmp_path, speaker, dataset, "early")
    assert run(cfg)[0] == EXIT_OK

    def only_generations_left() -> None:
        for child in (Path(cfg["output"]["uri"]) / "early").iterdir():
            if child.name != "generations":
                shutil.rmtree(child) if child.is_dir() else child.unlink()

    only_generations_left()
    code, _, progress = run(config(tmp_path, speaker, dataset, "early", temperature=0.5))
    assert code == EXIT_PERMANENT and "made with other settings" in (progress.last_error or ""), progress.last_error
    only_generations_left()  # the refused run stored its plan.json before it read the generations
    edited = rows(6)
    edited[2]["messages"][0]["content"] = edited[2]["messages"][0]["content"].replace("alpha", "gamma")
    write_jsonl(dataset, edited)
    code, _, progress = run(cfg)
    assert code == EXIT_PERMANENT and "dataset turns changed" in (progress.last_error or ""), progress.last_error
    only_generations_left()
    write_jsonl(dataset, rows(6))  # restored: its stored generations are captured, none generated again
    before = speaker.stats()["generations"]
    assert run(cfg)[0] == EXIT_OK and speaker.stats()["generations"] == before


def test_an_aborted_generation_is_asked_again_one_always_aborted_is_quarantined_and_a_server_aborting_all_stops(
    tmp_path: Path, speaker: RefServerProcess, speaking_tokenizer: ChatTokenizer
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", rows(6))
    server = RefServer(speaker.url, speaker.dump_dir, speaker.model)
    try:
        server.set_fault("abort", every=2, first_attempt_only=True)  # some rows aborted once
        cfg = config(tmp_path, speaker, dataset, "flaky")
        assert run(cfg)[0] == EXIT_OK
        aborted = len(speaker.stats()["faulted"])
        assert aborted >= 1 and speaker.stats()["generations"] == 6 + aborted
        records = check_captures(cfg, speaking_tokenizer, 6)
        assert all("quarantine" not in r or r["quarantine"]["reason"] != "server_error" for r in records.values())

        server.set_fault("abort", every=3)  # some rows the server always aborts: set aside, the run goes on
        cfg = config(tmp_path, speaker, dataset, "aborted")
        cfg["validation"]["maxRejectedRowRate"] = 1.0
        code, _, progress = run(cfg)
        always = len(set(speaker.stats()["faulted"]))
        assert code == EXIT_OK and 1 <= always < 6 and progress.quarantined[Reason.SERVER_ERROR] == always
        assert speaker.stats()["generations"] == 6 + 3 * always  # each such row asked 4 times
        assert sum("with 'abort' 4 times" in r.get("quarantine", {}).get("detail", "") for r in generations(cfg).values()) == always

        server.set_fault("abort", every=1)  # a server aborting most generations: the run stops, to be retried
        cfg = config(tmp_path, speaker, dataset, "overloaded")
        cfg["validation"]["gateMinSamples"] = 4
        code, _, progress = run(cfg)
        assert code == EXIT_TRANSIENT and "generations aborted" in (progress.last_error or ""), progress.last_error
        assert not (Path(cfg["output"]["uri"]) / "overloaded" / "generations").exists()  # nothing stored of it
    finally:
        server.set_fault(None)


def test_kills_during_generation_and_capture_resume_without_regenerating(
    tmp_path: Path, speaker: RefServerProcess, speaking_tokenizer: ChatTokenizer
) -> None:
    """Seeded sampling: the undisturbed run says what every row generates. A run killed once its second
    shard's generations are stored, then once more in the middle of a later shard's generation, ends
    with the same generations and captures; stored generations are never generated again."""
    dataset = write_jsonl(tmp_path / "d.jsonl", rows(24))

    def extract(run_id: str, kill_at: str | None = None) -> tuple[int, str]:
        path = tmp_path / f"{run_id}.json"
        path.write_text(json.dumps(config(tmp_path, speaker, dataset, run_id)))
        log = tmp_path / f"{run_id}.log"
        offset = log.stat().st_size if log.exists() else 0
        code = start_extract(path, log, {failpoints.ENV: kill_at} if kill_at else {}).wait(timeout=300)
        return code, log.read_text()[offset:]

    code, log = extract("calm")
    assert code == EXIT_OK, log[-3000:]
    want = generations(config(tmp_path, speaker, dataset, "calm"))
    cfg = config(tmp_path, speaker, dataset, "killed")
    code, first = extract("killed", "generations-stored#2")
    assert code == -9 and "killed at generations-stored #2" in first, first[-3000:]
    kept = {p.name: p.read_bytes() for p in (Path(cfg["output"]["uri"]) / "killed" / "generations").iterdir()}
    assert len(kept) == 2
    code, second = extract("killed", "generated#3")
    assert code == -9 and "killed at generated #3" in second, second[-3000:]
    code, third = extract("killed")
    assert code == EXIT_OK, third[-3000:]
    for name, data in kept.items():  # stored before the kills, read back as they were, generated once
        assert (Path(cfg["output"]["uri"]) / "killed" / "generations" / name).read_bytes() == data
        shard = int(name.split("-")[1].split(".")[0])
        assert f"shard {shard}: " not in second + third
    got = check_captures(cfg, speaking_tokenizer, 24)
    assert got == want  # the same seeded generations: none lost, none paired with another
    samples, _ = stored(cfg)
    calm, _ = stored(config(tmp_path, speaker, dataset, "calm"))
    assert sorted(samples) == sorted(calm)
    for index, sample in samples.items():
        assert np.array_equal(sample.hidden_states, calm[index].hidden_states)
