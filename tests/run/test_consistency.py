"""The consistency check's parts as plain functions: positions, the server's answer, the comparison,
the head read from real safetensors files (against transformers' own forward), the gate, batching."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.config import ConsistencySpec
from hsx_extractor.model import ModelConfigError
from hsx_extractor.run.consistency import (
    MAX_BATCH,
    Checker,
    CheckItem,
    Consistency,
    ConsistencyGate,
    SamplePicks,
    check_positions,
    compare_items,
    compare_position,
    log_softmax,
    logprob_request,
    parse_top_logprobs,
    summarize,
)
from hsx_extractor.run.lm_head import LmHead, bf16_to_float32, rms_norm
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.layer_stats import combine, layer_norms, sample_norm_sums
from hsx_extractor.storage.stored_json import ShardFormatError
from hsx_extractor.tools.reference_server import input_top_logprobs


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bits (as torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file written by hand (numpy has no bf16): name -> (dtype, raw array)."""
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def model_dir(tmp_path: Path, vocab: int = 300, hidden: int = 16, tied: bool = False, **config: Any) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    head = rng.normal(0, 1, (vocab, hidden)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    tensors = {"model.embed_tokens.weight": ("BF16", bf16_bits(head)), "model.norm.weight": ("F32", norm)}
    if not tied:
        tensors["lm_head.weight"] = ("BF16", bf16_bits(-head))
    write_safetensors(tmp_path / "model.safetensors", tensors)
    cfg = {"hidden_size": hidden, "num_hidden_layers": 4, "vocab_size": vocab, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": tied} | config))
    return tmp_path


# ---- what to ask ---------------------------------------------------------------------------------
def test_positions_spread_over_the_tail_and_predict_prompt_tokens() -> None:
    assert check_positions(1, 4) == []  # one token: nothing in the prompt to predict
    assert check_positions(2, 4) == [0]
    assert check_positions(100, 4) == [83, 88, 93, 98]
    assert check_positions(100, 1) == [98]
    for length in range(2, 40):
        got = check_positions(length, 4)
        assert got == sorted(set(got)) and 1 <= len(got) <= 4 and got[-1] == length - 2 and got[0] >= 0


def test_picks_are_the_first_accepted_samples_of_each_shard() -> None:
    picks = SamplePicks(2)
    offered = [(0, 3), (0, 4), (1, 9), (0, 5), (1, 10), (1, 11), (0, 6)]
    assert [picks.offer(k, i) for k, i in offered] == [True, True, True, False, True, False, False]
    assert picks.picked == {3, 4, 9, 10}
    none = SamplePicks(0)
    assert not none.offer(0, 1) and none.picked == set()


def test_the_reference_answer_lines_up_with_sglangs_convention() -> None:
    rng = np.random.default_rng(0)
    logprobs = log_softmax(rng.normal(0, 3, (12, 50))).astype(np.float32)
    positions = check_positions(12, 3)
    ask = logprob_request(positions, 5)
    assert ask == {"return_logprob": True, "logprob_start_len": positions[0], "top_logprobs_num": 5}
    rows = input_top_logprobs(logprobs, positions[0], 5)
    assert rows[0] is None and len(rows) == 12 - positions[0]  # as SGLang: one per token from start
    got = parse_top_logprobs({"meta_info": {"input_top_logprobs": rows}}, positions[0], positions)
    for p in positions:  # the state at p predicts token p + 1: row p of the model's logprobs
        best = np.argsort(-logprobs[p])[:5]
        assert [t for t, _ in got[p]] == best.tolist()
        assert np.allclose([lp for _, lp in got[p]], logprobs[p, best])
    with pytest.raises(ValueError, match="input_top_logprobs"):
        parse_top_logprobs({"meta_info": {}}, positions[0], positions)
    with pytest.raises(ValueError, match="position"):
        parse_top_logprobs({"meta_info": {"input_top_logprobs": rows[:2]}}, positions[0], positions)


# ---- how to compare ------------------------------------------------------------------------------
def server_top(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    lp = log_softmax(logits[None])[0]
    return [(int(t), float(lp[t])) for t in np.argsort(-lp, kind="stable")[:k]]


def test_agreement_within_tolerance_and_disagreement_beyond_it() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 4, 1000).astype(np.float32)
    top = server_top(logits, 5)
    assert compare_position(7, logits, top, 0.05, 0.0).ok
    assert compare_position(7, logits + 3.0, top, 0.05, 0.0).ok  # a constant shift is no change
    noisy = logits + rng.normal(0, 0.005, logits.shape).astype(np.float32)
    assert compare_position(7, noisy, top, 0.05, 0.0).ok
    bent = logits.copy()
    bent[top[0][0]] -= 0.2
    res = compare_position(7, bent, top, 0.05, 0.0)
    assert not res.ok and "position 7" in res.detail and res.max_error > 0.05
    assert compare_position(7, bent, top, 0.05, 0.2 / np.abs(logits).max()).ok  # the relative part


def test_a_token_outside_the_servers_top_k_ranking_above_it_is_caught() -> None:
    logits = np.linspace(0, 5, 200).astype(np.float32)  # token 199 best, then 198, ...
    top = server_top(logits, 3)
    spoiled = logits.copy()
    spoiled[10] = 10.0  # ranks first here, absent from the server's top 3
    # The server's three tokens move with the normaliser: both rules fire; a bare intruder below
    # them but above the server's 3rd is the second rule alone.
    assert not compare_position(0, spoiled, top, 0.05, 0.0).ok
    lp = log_softmax(logits[None])[0]
    intruder = logits.copy()
    intruder[10] = logits[197] + 0.5  # between the server's 2nd and 3rd, normaliser barely moved
    res = compare_position(0, intruder, top, 0.2, 0.0)
    assert not res.ok and "token 10 ranks in the top 3" in res.detail, res
    tie = logits.copy()
    tie[10] = logits[197] - 0.01  # within tolerance of the 3rd: may rank either way
    assert compare_position(0, tie, top, 0.2, 0.0).ok and lp[10] < lp[197]


def test_a_server_token_outside_the_vocabulary_fails() -> None:
    res = compare_position(0, np.zeros(10, np.float32), [(12, -1.0)], 0.05, 0.0)
    assert not res.ok and "outside vocab" in res.detail


# ---- the head, read from safetensors -------------------------------------------------------------
def test_head_streams_blocks_and_equals_a_plain_matmul(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    states = np.random.default_rng(3).normal(0, 1, (5, 16)).astype(np.float32)
    whole = LmHead(d)
    small = LmHead(d, block_bytes=7 * 16 * 2)  # 7 rows a block: 43 blocks, a ragged last one
    assert small.rows_per_block == 7 and (small.vocab_size, small.hidden_size) == (300, 16)
    weight = -bf16_to_float32(bf16_bits(np.random.default_rng(1).normal(0, 1, (300, 16)).astype(np.float32)))
    want = states @ weight.T
    assert np.allclose(whole.logits(states), want, atol=1e-4)
    assert np.array_equal(small.logits(states), whole.logits(states))


def test_tied_embeddings_fall_back_to_embed_tokens(tmp_path: Path) -> None:
    head = LmHead(model_dir(tmp_path, tied=True))
    assert head.head.name == "model.embed_tokens.weight"


def test_untied_model_uses_lm_head_and_a_missing_head_is_refused(tmp_path: Path) -> None:
    assert LmHead(model_dir(tmp_path / "a")).head.name == "lm_head.weight"
    d = tmp_path / "b"
    d.mkdir()
    write_safetensors(d / "model.safetensors", {"x.weight": ("F32", np.zeros((2, 2), np.float32))})
    (d / "config.json").write_text(json.dumps({"hidden_size": 2, "num_hidden_layers": 4}))
    with pytest.raises(ModelConfigError, match="no lm_head"):
        LmHead(d)


def test_logit_softcapping_and_scale_follow_the_config(tmp_path: Path) -> None:
    states = np.random.default_rng(4).normal(0, 3, (2, 16)).astype(np.float32)
    plain = LmHead(model_dir(tmp_path / "a")).logits(states)
    capped = LmHead(model_dir(tmp_path / "b", final_logit_softcapping=2.0, logit_scale=0.5)).logits(states)
    assert np.allclose(capped, 2.0 * np.tanh(plain * 0.5 / 2.0), atol=1e-5)


def test_head_and_norm_reproduce_transformers_on_the_tiny_model(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    ids = torch.tensor([[1, *range(20, 60)]])
    seen: list[torch.Tensor] = []
    handle = model.get_decoder().norm.register_forward_hook(lambda _m, a, _o: seen.append(a[0]))
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
    handle.remove()
    head = LmHead(tiny_model)
    post = out.hidden_states[-1][0].numpy()
    assert np.allclose(head.logits(post), out.logits[0].numpy(), atol=1e-4)
    normed = head.final_norm(seen[0][0].numpy())
    assert np.allclose(normed, post, atol=1e-5)
    assert np.allclose(rms_norm(post, np.ones(post.shape[1], np.float32), 1e-6), post / np.sqrt((post**2).mean(-1, keepdims=True) + 1e-6))


def test_compare_items_takes_pre_norm_states_through_the_norm(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    ids = [1, *range(30, 90)]
    seen: list[torch.Tensor] = []
    handle = model.get_decoder().norm.register_forward_hook(lambda _m, a, _o: seen.append(a[0]))
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    handle.remove()
    logprobs = torch.log_softmax(out.logits[0], -1).numpy()
    positions = check_positions(len(ids), 4)
    server = parse_top_logprobs(
        {"meta_info": {"input_top_logprobs": input_top_logprobs(logprobs, positions[0], 5)}}, positions[0], positions
    )
    head, spec = LmHead(tiny_model), ConsistencySpec()
    post = bf16_bits(out.hidden_states[-1][0].numpy())[positions]
    pre = bf16_bits(seen[0][0].numpy())[positions]
    [ok_post] = compare_items([CheckItem(1, post, server)], head, "post-norm", spec)
    [ok_pre] = compare_items([CheckItem(2, pre, server)], head, "pre-norm", spec)
    [mixed] = compare_items([CheckItem(3, pre, server)], head, "post-norm", spec)
    assert ok_post.ok and ok_pre.ok and ok_post.max_error < 0.005, (ok_post, ok_pre)
    assert not mixed.ok and mixed.max_error > 0.1  # pre-norm states labelled post-norm


# ---- batching, the gate, the record --------------------------------------------------------------
def test_checker_batches_waiting_requests_into_one_pass(tmp_path: Path) -> None:
    head, spec = LmHead(model_dir(tmp_path)), ConsistencySpec()
    rng = np.random.default_rng(5)
    weight = -bf16_to_float32(bf16_bits(np.random.default_rng(1).normal(0, 1, (300, 16)).astype(np.float32)))

    def item(i: int, wrong: bool) -> CheckItem:
        states = rng.normal(0, 1, (3, 16)).astype(np.float32)
        shown = -states if wrong else states
        return CheckItem(i, bf16_bits(shown), {p: server_top(states[j] @ weight.T, 5) for j, p in enumerate((4, 5, 6))})

    async def go() -> tuple[list[Any], int]:
        checker = Checker(head, spec, "post-norm")
        results = await asyncio.gather(*(checker.check(item(i, i == 3)) for i in range(6)))
        return list(results), checker.passes

    results, passes = asyncio.run(go())
    assert [r.ok for r in results] == [True, True, True, False, True, True]
    assert passes <= 2  # the first request alone, then all that waited meanwhile
    summary = summarize(results)
    assert summary["checked"] == list(range(6)) and summary["failed"] == [3]


def test_a_sample_is_not_checked_while_the_checker_is_behind(tmp_path: Path) -> None:
    head, spec = LmHead(model_dir(tmp_path)), ConsistencySpec()
    item = CheckItem(0, bf16_bits(np.ones((1, 16), np.float32)), {5: [(0, -1.0)]})

    picks = SamplePicks(2)
    picks.offer(0, 1), picks.offer(0, 2)

    async def go() -> tuple[list[int], list[int], int]:
        consistency = Consistency(Checker(head, spec, "post-norm"), ConsistencyGate(1.0, 1), picks)
        waiting = [asyncio.create_task(consistency.checker.check(item)) for _ in range(2 * MAX_BATCH)]
        await asyncio.sleep(0)  # all enqueued: two full passes wait
        behind = consistency.plan(1, 50)
        await asyncio.gather(*waiting)
        return behind, consistency.plan(2, 50), consistency.skipped

    behind, caught_up, skipped = asyncio.run(go())
    assert behind == [] and skipped == 1 and caught_up == check_positions(50, spec.positions)


def test_gate_fails_early_only_from_min_checks_and_at_the_end_on_any() -> None:
    gate = ConsistencyGate(max_failure_rate=0.25, min_checks=4)
    gate.record(False, "sample 1: bad")
    assert gate.verdict() is None  # one check: too early to judge
    assert gate.verdict(final=True) is not None  # the run's end judges whatever it has
    for _ in range(3):
        gate.record(True)
    assert gate.verdict() is None  # 1 of 4 = 0.25: not above the limit
    gate.record(False, "sample 9: bad")
    message = gate.verdict()
    assert message is not None and message.startswith("CaptureInconsistent: 2 of 5") and "sample 9" in message
    resumed = ConsistencyGate(0.1, 4)
    resumed.add(checked=4, failed=4)  # an earlier process's commit records
    assert resumed.verdict() is not None


def test_layer_norm_statistics_are_the_token_norms_of_each_layer() -> None:
    rng = np.random.default_rng(6)
    hidden, k = 8, 3
    aux = rng.normal(0, 1, (200, k * hidden)).astype(np.float32) * np.repeat([1.0, 2.0, 4.0], hidden)
    final = rng.normal(0, 1, (200, hidden)).astype(np.float32)
    a, f = bf16_bits(aux), bf16_bits(final)
    part = sample_norm_sums(a, f, hidden)
    assert part.shape == (k + 1, 5) and part[0, 0] == 64  # 64 evenly spaced tokens of 200
    whole = layer_norms(combine([part, sample_norm_sums(a[:10], f[:10], hidden)]))
    assert whole is not None and len(whole["aux"]) == k and whole["final"]["tokens"] == 74
    means = [e["mean"] for e in whole["aux"]]
    assert means[0] * 1.8 < means[1] < means[2] / 1.8  # the scaled layers stand apart
    take = np.unique(np.linspace(0, 199, 64).round().astype(int))
    direct = np.linalg.norm(bf16_to_float32(f[take]), axis=1)
    assert part[-1, 3] == pytest.approx(direct.min()) and part[-1, 4] == pytest.approx(direct.max())
    assert layer_norms(combine([])) is None


def test_commit_record_keeps_norms_and_checks_and_refuses_damaged_ones() -> None:
    commit = ShardCommit(
        0, 2, 0, 10, 10, "shards/x", "0123456789abcdef", 0, 2, (0, 1), (),
        layer_norms={"aux": [{"tokens": 3, "mean": 1.0, "std": 0.1, "min": 0.9, "max": 1.1}],
                     "final": {"tokens": 3, "mean": 2.0, "std": 0.0, "min": 2.0, "max": 2.0}},
        consistency={"checked": [1], "failed": [], "maxLogprobError": 0.001},
    )  # fmt: skip
    back = ShardCommit.from_json(json.loads(json.dumps(commit.to_json())))
    assert back.layer_norms == commit.layer_norms and back.consistency == commit.consistency
    assert back.content() == commit.content()
    bad = commit.to_json() | {"consistency": {"checked": [1], "failed": [0], "maxLogprobError": 0}}
    with pytest.raises(ShardFormatError, match="failed requests must be checked"):
        ShardCommit.from_json(bad)
    with pytest.raises(ShardFormatError, match="checked index"):
        ShardCommit.from_json(commit.to_json() | {"consistency": {"checked": [7], "failed": [], "maxLogprobError": 0}})
    with pytest.raises(ShardFormatError, match="layerNorms"):
        ShardCommit.from_json(commit.to_json() | {"layerNorms": {"aux": [{"tokens": "x"}]}})
    plain = {k: v for k, v in commit.to_json().items() if k not in ("layerNorms", "consistency")}
    old = ShardCommit.from_json(plain)  # records written before these fields exist
    assert old.layer_norms is None and old.consistency is None
