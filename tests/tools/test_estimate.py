"""``hsx estimate``: the formula, and agreement with the bytes the shard format really produces."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from hsx_extractor.contract import EXIT_PERMANENT
from hsx_extractor.model import ModelConfigError, model_dims
from hsx_extractor.storage import shard_format as shards
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.tools.estimate import (
    DEFAULT_RATIOS,
    EstimateError,
    Rows,
    estimate_storage,
    format_estimate,
    trial_ratio,
)
from hsx_extractor.tools.estimate_cli import add_estimate_command

H, K = 64, 3


def random_records(n: int, seed: int = 0) -> list[shards.SampleRecord]:
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        length = int(rng.integers(3, 300))
        # Activation-like bf16: normal values with per-channel scales, so the exponent plane compresses.
        scales = rng.lognormal(0.0, 1.0, size=(K + 1) * H).astype(np.float32)
        values = (rng.standard_normal((length, (K + 1) * H)).astype(np.float32) * scales).view(np.uint32)
        bits = (values >> 16).astype(np.uint16)
        records.append(
            shards.SampleRecord(
                index=i,
                sample_id=f"chat-{i}",
                input_ids=rng.integers(0, 50_000, length).astype(np.int32),
                loss_mask=rng.integers(0, 2, length).astype(np.uint8),
                aux_hidden_states=np.ascontiguousarray(bits[:, : K * H]),
                hidden_states=np.ascontiguousarray(bits[:, K * H :]),
            )
        )
    return records


def shard_bytes(records: list[shards.SampleRecord], compression: str) -> tuple[int, int]:
    """(object bytes of one shard holding ``records``, stored bytes of their hidden states)."""
    encoded = [shards.encode_sample(r, shards.COMPRESSION_CODECS[compression]) for r in records]
    header, _ = shards.layout_shard(0, [e.entry for e in encoded])
    hidden = sum(t.length for e in encoded for t in e.entry.tensors if t.dtype == "BF16")
    return len(header) + sum(len(e.payload) for e in encoded), hidden


def rows_of(records: list[shards.SampleRecord]) -> Rows:
    return Rows(tuple(r.seq_len for r in records), tuple(r.sample_id for r in records))


def test_hidden_bytes_follow_the_formula() -> None:
    rows = Rows.uniform(samples=10, tokens=20_480)
    est = estimate_storage(
        rows, hidden_size=7168, num_aux_layers=3, compression="none", shard_target_bytes=1 << 30
    )
    assert est.hidden_bytes == 20_480 * (3 + 1) * 7168 * 2
    assert est.token_bytes >= 20_480 * 5
    assert est.stored_bytes == est.raw_bytes


def test_compressed_estimate_divides_hidden_states_only() -> None:
    rows = Rows.uniform(samples=4, tokens=8192)
    est = estimate_storage(rows, 4096, 3, "bf16-zstd", 1 << 30, ratio=1.6)
    expected = -(-est.hidden_bytes * 10 // 16) + est.token_bytes + est.index_bytes
    assert est.stored_bytes == expected
    assert est.assumed_ratio == 1.6
    assert estimate_storage(rows, 4096, 3, "bf16-zstd", 1 << 30).assumed_ratio == DEFAULT_RATIOS["bf16-zstd"]


def test_uncompressed_estimate_matches_a_real_shard_within_half_a_percent() -> None:
    records = random_records(40)
    actual, _ = shard_bytes(records, "none")
    est = estimate_storage(rows_of(records), H, K, "none", 1 << 30)
    # The estimate also counts the commit record, plan and manifest: a few KiB at most.
    assert 0 <= est.raw_bytes - actual <= 0.005 * actual, (est.raw_bytes, actual)


def test_compressed_estimate_matches_a_real_shard_given_the_measured_ratio() -> None:
    records = random_records(40, seed=1)
    actual, hidden_stored = shard_bytes(records, "bf16-zstd")
    raw_hidden = sum(r.aux_hidden_states.nbytes + r.hidden_states.nbytes for r in records)
    ratio = raw_hidden / hidden_stored
    assert 1.0 < ratio < 2.0  # the codec really compressed, and the raw low byte bounds it
    est = estimate_storage(rows_of(records), H, K, "bf16-zstd", 1 << 30, ratio=ratio)
    assert abs(est.stored_bytes - actual) <= 0.01 * actual, (est.stored_bytes, actual)


def test_fp8_estimate_is_exact_without_a_ratio() -> None:
    records = random_records(40, seed=2)
    actual, hidden_stored = shard_bytes(records, "fp8-e4m3")
    # one byte per value and a float32 scale per token, for each of the two hidden-state tensors
    assert hidden_stored == sum(r.aux_hidden_states.size + r.hidden_states.size + 8 * r.seq_len for r in records)
    est = estimate_storage(rows_of(records), H, K, "fp8-e4m3", 1 << 30)
    assert 0 <= est.stored_bytes - actual <= 0.005 * actual, (est.stored_bytes, actual)


def test_a_trial_ratio_from_the_manifest_is_applied_to_the_bytes_it_was_measured_on() -> None:
    """A trial's manifest reports bytesRaw (every tensor, raw) / bytesStored (the shard objects, headers
    and padding included). Applied to the same bytes of the estimate, it gives the shard back."""
    from hsx_extractor.storage.manifest import build_manifest

    records = random_records(40, seed=2)
    encoded = [shards.encode_sample(r, shards.COMPRESSION_CODECS["bf16-zstd"]) for r in records]
    header, placed = shards.layout_shard(0, [e.entry for e in encoded])
    stored = len(header) + sum(e.length for e in placed)  # what the store uploads (SpooledObject.size)
    raw = sum(r.input_ids.nbytes + r.loss_mask.nbytes + r.aux_hidden_states.nbytes + r.hidden_states.nbytes
              for r in records)  # fmt: skip
    commit = ShardCommit(0, len(placed), 0, stored, raw, "shards/x", "0" * 16)
    ratio = build_manifest("trial", "bf16-zstd", [commit], {})["compression"]["ratio"]
    assert ratio == round(raw / stored, 4)

    est = estimate_storage(rows_of(records), H, K, "bf16-zstd", 1 << 30, ratio=ratio, ratio_basis="shards")
    assert est.tensor_bytes == raw
    outside = est.index_bytes - est.header_bytes  # commit record, plan, manifest: never in a shard
    assert est.stored_bytes == math.ceil(raw / ratio) + outside
    # The shard part is the real shard, up to the 4 digits the manifest rounds the ratio to.
    assert abs((est.stored_bytes - outside) - stored) <= stored * 1e-4, (est.stored_bytes - outside, stored)
    # The same number used as a hidden-state ratio (the default basis) misses: ids, masks and headers
    # were in the trial's bytes, so dividing the hidden states alone by it counts them twice over.
    as_hidden = estimate_storage(rows_of(records), H, K, "bf16-zstd", 1 << 30, ratio=ratio)
    assert as_hidden.stored_bytes - as_hidden.index_bytes + as_hidden.header_bytes - stored > 0.01 * stored


def test_the_cli_takes_a_ratio_as_measured_on_shards_unless_told(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--tokens", "100000", "--samples", "50", "--hidden-size", "64", "--num-layers", "8",
            "--json", "--compression-ratio", "1.25"]  # fmt: skip
    _, out = run_cli(argv, capsys)
    body = json.loads(out)
    assert body["ratioMeasuredOn"] == "shards"
    assert body["tensorBytes"] == body["hiddenBytes"] + 100_000 * 5
    assert body["storedBytes"] == -(-body["tensorBytes"] * 4 // 5) + body["indexBytes"] - body["headerBytes"]
    _, out = run_cli([*argv, "--ratio-measured-on", "hidden"], capsys)
    body = json.loads(out)
    assert body["ratioMeasuredOn"] == "hidden"
    assert body["storedBytes"] == -(-body["hiddenBytes"] * 4 // 5) + body["tokenBytes"] + body["indexBytes"]
    _, out = run_cli(argv[:-2], capsys)
    assert json.loads(out)["ratioMeasuredOn"] == "hidden"  # the default ratio is a hidden-state one


def test_a_trial_run_gives_its_hidden_state_ratio_to_the_hidden_states(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hsx_extractor.config import OutputSpec
    from hsx_extractor.storage.store import open_store
    from tests.storage.samples import plan_for, record, seq_len_of, write_run

    output = OutputSpec.model_validate({"uri": str(tmp_path / "out"), "compression": "bf16-zstd"})
    write_run(open_store(output, "trial"), plan_for(12, 5), quarantine=frozenset({3}))
    # Independently: the same samples encoded with the codec, their BF16 tensors' raw and stored bytes.
    encoded = [shards.encode_sample(record(i, seq_len_of(i)), shards.COMPRESSION_CODECS["bf16-zstd"])
               for i in range(12) if i != 3]  # fmt: skip
    bf16 = [t for e in encoded for t in e.entry.tensors if t.dtype == "BF16"]
    expected = sum(t.raw_length for t in bf16) / sum(t.length for t in bf16)
    assert trial_ratio(str(tmp_path / "out" / "trial")) == (pytest.approx(expected), 11)
    argv = ["estimate", "--tokens", "100000", "--samples", "50", "--hidden-size", "64", "--num-layers", "8",
            "--json", "--trial", str(tmp_path / "out" / "trial")]  # fmt: skip
    code, out = run_cli(argv, capsys)
    body = json.loads(out)
    assert code == 0 and body["ratioMeasuredOn"] == "hidden" and body["assumedRatio"] == pytest.approx(expected)
    assert body["storedBytes"] == math.ceil(body["hiddenBytes"] / body["assumedRatio"]) + body["tokenBytes"] + body["indexBytes"]
    code, out = run_cli([*argv[:-1], str(tmp_path / "out" / "none")], capsys)
    assert code == EXIT_PERMANENT and "no committed shard" in out and "Traceback" not in out


def test_rejected_and_duplicate_rows_write_no_hidden_states() -> None:
    rows = Rows(lengths=(100, None, 100, 50), ids=("a", None, "a", "b"))
    est = estimate_storage(rows, 128, 3, "none", 1 << 30)
    assert (est.samples, est.tokens, est.quarantined) == (2, 150, 2)
    assert est.hidden_bytes == 150 * 4 * 128 * 2


def test_shards_follow_the_plan_target() -> None:
    rows = Rows.uniform(samples=100, tokens=100 * 1000)
    per_sample = 1000 * ((K + 1) * H * 2 + 5)
    est = estimate_storage(rows, H, K, "none", shard_target_bytes=10 * per_sample)
    assert est.shards == 10


def test_large_datasets_scale_the_index_instead_of_laying_out_every_shard() -> None:
    small = estimate_storage(Rows.uniform(20_000, 20_000 * 512), H, K, "none", 1 << 24)
    large = estimate_storage(Rows.uniform(80_000, 80_000 * 512), H, K, "none", 1 << 24)
    assert large.hidden_bytes == 4 * small.hidden_bytes
    assert 3.9 < large.index_bytes / small.index_bytes < 4.1


@pytest.mark.parametrize(
    ("compression", "ratio"), [("none", 1.3), ("bf16-zstd", 2.5), ("bf16-zstd", 0.9), ("lz4", None)]
)
def test_impossible_ratios_and_codecs_are_refused(compression: str, ratio: float | None) -> None:
    with pytest.raises(EstimateError):
        estimate_storage(Rows.uniform(1, 10), H, K, compression, 1 << 30, ratio=ratio)


def test_model_dims_reads_text_config_of_multimodal_models() -> None:
    kimi_like = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": 7168,
            "num_hidden_layers": 61,
        },
    }
    dims = model_dims(kimi_like)
    assert (dims.hidden_size, dims.num_layers) == (7168, 61)
    flat = model_dims({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32})
    assert (flat.hidden_size, flat.num_layers, flat.architecture) == (4096, 32, "LlamaForCausalLM")
    with pytest.raises(ModelConfigError, match="hidden_size"):
        model_dims({"architectures": ["X"]})


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code and what was printed: the result on stdout, or (an error) only on stderr."""
    parser = argparse.ArgumentParser(prog="hsx")
    add_estimate_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    captured = capsys.readouterr()
    assert (code == 0) == bool(captured.out) and (code == 0) == (not captured.err), captured
    return code, captured.out or captured.err


def test_cli_prints_raw_and_compressed_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(
        ["estimate", "--tokens", "2048000", "--hidden-size", "7168", "--num-layers", "61"], capsys
    )
    assert code == 0
    assert "raw" in out and "stored" in out and "1.45x" in out
    code, out = run_cli(
        [
            "estimate",
            "--tokens",
            "2048000",
            "--hidden-size",
            "7168",
            "--num-layers",
            "61",
            "--json",
            "--compression",
            "none",
        ],
        capsys,
    )
    body = json.loads(out)
    assert body["hiddenBytes"] == 2_048_000 * 4 * 7168 * 2
    assert body["storedBytes"] == body["rawBytes"]
    assert body["samples"] == 1000


def test_cli_counts_aux_layer_ids(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "estimate",
        "--tokens",
        "1000",
        "--samples",
        "1",
        "--hidden-size",
        "8",
        "--num-layers",
        "32",
        "--json",
    ]
    _, out = run_cli([*argv, "--aux-layer-ids", "1", "15", "28", "30"], capsys)
    assert json.loads(out)["auxLayers"] == 4


def test_cli_explains_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["estimate", "--tokens", "1000", "--hidden-size", "64"], capsys)
    assert code == EXIT_PERMANENT and "--num-layers" in out
    code, out = run_cli(
        [
            "estimate",
            "--tokens",
            "1000",
            "--hidden-size",
            "64",
            "--num-layers",
            "8",
            "--compression-ratio",
            "3",
        ],
        capsys,
    )
    assert code == EXIT_PERMANENT and "[1, 2]" in out


def test_format_mentions_quarantined_rows() -> None:
    est = estimate_storage(Rows((10, None), ("a", None)), H, K, "bf16-zstd", 1 << 30)
    assert "1 rows that will be quarantined" in format_estimate(est)


def test_cli_reports_bad_paths_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hsx_extractor.tools.tinymodel import build_tokenizer

    model = tmp_path / "m"
    model.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 8}
    (model / "config.json").write_text(json.dumps(config))
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"id": 1, "input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    code, out = run_cli(["estimate", "--dataset", str(dataset), "--model", str(model)], capsys)
    assert code == EXIT_PERMANENT and "holds no tokenizer" in out and "Traceback" not in out
    build_tokenizer(model, 512)
    template = tmp_path / "t.jinja"
    code, out = run_cli(["estimate", "--dataset", str(dataset), "--model", str(model), "--chat-template", str(template)], capsys)
    assert code == EXIT_PERMANENT and "t.jinja" in out
    code, out = run_cli(["estimate", "--dataset", str(tmp_path / "absent.jsonl"), "--model", str(model)], capsys)
    assert code == EXIT_PERMANENT and "does not exist" in out
    code, out = run_cli(["estimate", "--dataset", str(dataset), "--model", str(model)], capsys)
    assert code == 0, out


def test_a_trial_whose_commit_record_names_another_runs_object_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--trial reads shard headers through commit records: one naming an object outside the trial
    (here the other run's, whose ratio would be measured instead) stops the estimate with the reason."""
    from hsx_extractor.config import OutputSpec
    from hsx_extractor.storage.store import open_store
    from tests.storage.samples import plan_for, write_run

    output = OutputSpec.model_validate({"uri": str(tmp_path / "out"), "compression": "bf16-zstd"})
    for run_id in ("trial", "other"):
        write_run(open_store(output, run_id), plan_for(6, 3))
    (record,) = (tmp_path / "out" / "trial").glob("**/commits/shard-000000*")
    body = json.loads(record.read_text())
    body["key"] = body["key"].replace("trial/", "other/", 1)
    record.write_text(json.dumps(body))
    argv = ["estimate", "--tokens", "1000", "--samples", "5", "--hidden-size", "64", "--num-layers", "8",
            "--trial", str(tmp_path / "out" / "trial")]  # fmt: skip
    code, out = run_cli(argv, capsys)
    assert code == EXIT_PERMANENT and "names key 'other/" in out and "not this run's" in out and "Traceback" not in out


def test_a_regenerating_estimate_counts_prompts_and_the_decode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--responses regenerate: each row is its prompt plus the generated turns (--mean-new-tokens each, at most
    --max-new-tokens), priced as samples, and the decode it takes is printed."""
    from hsx_extractor.run.tokens import ChatTokenizer
    from hsx_extractor.tools.tinymodel import build_tiny_model

    model = build_tiny_model(tmp_path / "m")
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)]
    rows.append({"id": "t", "input_ids": [1, 5], "loss_mask": [0, 1]})  # no turns to regenerate
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = ChatTokenizer(model)
    prompts = [len(tok.encode_chat(r["messages"], None, True).ids) for r in rows[:4]]
    argv = ["estimate", "--dataset", str(dataset), "--model", str(model), "--max-length", "512", "--json",
            "--responses", "regenerate", "--max-new-tokens", "100", "--mean-new-tokens", "10"]  # fmt: skip
    code, out = run_cli(argv, capsys)
    assert code == 0, out
    got = json.loads(out)
    assert got["samples"] == 4 and got["quarantined"] == 1
    assert got["tokens"] == sum(prompts) + 4 * (10 + 16)  # prompt + mean new tokens + the end-of-turn allowance
    assert got["generation"] == {"rows": 4, "turns": 4, "promptTokens": sum(prompts), "maxNewTokens": 400,
                                 "newTokens": 40}  # fmt: skip
    code, out = run_cli(argv[:-2], capsys)  # no mean given: every turn at its most
    assert json.loads(out)["generation"]["newTokens"] == 400
    code, out = run_cli(["estimate", "--tokens", "100", "--hidden-size", "64", "--num-layers", "8",
                         "--responses", "regenerate"], capsys)  # fmt: skip
    assert code == EXIT_PERMANENT and "needs --dataset" in out
