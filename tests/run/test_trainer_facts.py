"""Whole runs against the real reference server: the manifest says what the data is, its token
counts equal the dataset's loss-masked tokens counted independently (transformers' own chat
template rendering), a resumed run counts no shard twice, and `hsx vocab` turns them into d2t/t2d."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from hsx_extractor import __version__
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.model import model_fingerprint
from hsx_extractor.reader import OutputReader
from hsx_extractor.run.plan import ShardPlan
from hsx_extractor.run.tokens import ChatTokenizer
from hsx_extractor.storage.commit_record import ShardCommit

from .helpers import RefServer, base_config, chat_rows, write_jsonl
from .test_pipeline import run, verified

HSX = [sys.executable, "-m", "hsx_extractor.tools.cli"]


def independent_counts(model_dir: Path, rows: list[Any]) -> Counter[int]:
    """Loss-masked token counts of the well-formed rows, from transformers' apply_chat_template."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    counts: Counter[int] = Counter()
    for row in rows:
        if not isinstance(row, dict):
            continue
        enc = tok.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        counts.update(t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m)
    return counts


def manifest_counts(manifest: dict[str, Any]) -> Counter[int]:
    tc = manifest["tokenCounts"]
    assert tc["ids"] == sorted(tc["ids"]) and tc["total"] == sum(tc["counts"])
    return Counter(dict(zip(tc["ids"], tc["counts"], strict=True)))


def record_counts(run_dir: Path) -> list[Counter[int]]:
    """The token counts of each commit record, as stored."""
    out = []
    for path in sorted((run_dir / "commits").iterdir()):
        commit = ShardCommit.from_bytes(path.read_bytes())
        assert commit.token_counts is not None
        out.append(Counter(commit.token_counts))
    return out


def test_manifest_says_what_the_data_is_and_counts_match_the_dataset(
    tmp_path: Path, ref_server: RefServer, tokenizer: ChatTokenizer
) -> None:
    rows: list[Any] = chat_rows(80, words=30)
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = base_config(tmp_path, ref_server, dataset)
    code, result, _ = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    manifest = result.manifest
    run_dir = tmp_path / "out" / "run"
    assert manifest == json.loads((run_dir / "manifest.json").read_text())
    assert manifest["format"] == "hsx-manifest/2"
    assert manifest["capture"] == {
        "engine": "hsx-reference",
        "engineVersion": __version__,
        "layerIds": [2, 4, 5],
        "layerConvention": "layer-input",
        "finalState": "post-norm",
        "dtype": "bfloat16",
    }
    assert manifest["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    assert manifest["tokenizer"]["chatTemplate"] == tokenizer.chat_template
    assert manifest["tokenizer"]["bosHandling"] in {"template", "none"}
    assert manifest["dataset"] == {
        "uri": str(dataset),
        "digest": "sha256:" + hashlib.sha256(dataset.read_bytes()).hexdigest(),
        "bytes": dataset.stat().st_size,
        # The rows the shards were cut from, as plan.json digests them (not the file as it is later).
        "rowsDigest": ShardPlan.from_json(json.loads((run_dir / "plan.json").read_text())).rows_digest,
    }
    assert len(manifest["dataset"]["rowsDigest"]) == 16
    assert manifest["run"]["vocabSize"] == tokenizer.vocab_size
    # What `hsx export --model` checks a model's norm against (the weight's own bytes).
    from safetensors.numpy import load_file

    norm = load_file(str(ref_server.model / "model.safetensors"))["model.norm.weight"]
    assert manifest["run"]["finalNormDigest"] == "sha256:" + hashlib.sha256(norm.tobytes()).hexdigest()[:32]
    assert manifest["run"]["modelFingerprint"] == model_fingerprint(ref_server.model)
    # One place per fact: nothing the sections hold is repeated in `run`.
    assert not {"captureLayers", "tokenizerFingerprint", "dataset", "hsxVersion"} & set(manifest["run"])

    want = independent_counts(ref_server.model, rows)
    assert sum(want.values()) > 1000 and manifest_counts(manifest) == want
    per_shard = record_counts(run_dir)
    assert len(per_shard) >= 3 and sum(per_shard, Counter()) == want
    assert OutputReader(str(run_dir)).capture.layer_ids == (2, 4, 5)
    verified(cfg)  # recomputes the manifest's counts from the records and the records' from the samples

    out = tmp_path / "vocab"
    cli = subprocess.run(
        [*HSX, "vocab", str(run_dir), "--draft-vocab-size", "16", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == EXIT_OK, cli.stderr
    summary = json.loads(cli.stdout)
    vocab = tokenizer.vocab_size
    assert summary["draftVocabSize"] == 16 and summary["targetVocabSize"] == vocab
    mapping = torch.load(out / "vocab_mapping.pt", weights_only=True)
    d2t, t2d = mapping["d2t"], mapping["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (16,) and t2d.dtype == torch.bool and t2d.shape == (vocab,)
    # The 16 most frequent masked tokens (ties to the lower id), and draft k -> target k + d2t[k].
    top = sorted(want, key=lambda t: (-want[t], t))[:16]
    assert torch.nonzero(t2d).flatten().tolist() == sorted(top)
    assert (torch.arange(16) + d2t).tolist() == sorted(top)
    assert np.array_equal(np.load(out / "d2t.npy"), d2t.numpy()) and np.load(out / "d2t.npy").dtype == np.int64
    assert np.array_equal(np.load(out / "t2d.npy"), t2d.numpy()) and np.load(out / "t2d.npy").dtype == np.bool_
    assert torch.load(out / "token_freq.pt", weights_only=True) == dict(want)
    assert summary["coverage"] == round(sum(want[t] for t in top) / sum(want.values()), 6)


def test_a_resumed_run_counts_each_shard_once(tmp_path: Path, ref_server: RefServer) -> None:
    """The first run stops at row 40 after committing the shards before it; the second commits the
    rest. The manifest's counts are exactly the dataset's, nothing counted twice."""
    rows: list[Any] = ["not json", *chat_rows(79, words=30)]  # row 0 never reaches the server
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    ref_server.set_fault("nan", every=40)
    cfg = base_config(tmp_path, ref_server, dataset, concurrency=1, validation__onMismatch="fail")
    assert run(cfg)[0] == EXIT_PERMANENT
    run_dir = tmp_path / "out" / "run"
    plan = json.loads((run_dir / "plan.json").read_text())
    first = sorted(p.name for p in (run_dir / "commits").iterdir())
    assert 0 < len(first) < len(plan["shards"]) and not (run_dir / "manifest.json").exists()

    ref_server.set_fault(None)
    code, result, progress = run(cfg)
    assert code == EXIT_OK and result is not None and result.manifest is not None
    assert progress.shards_committed == len(plan["shards"]) and len(result.commits) == len(plan["shards"]) - len(first)
    want = independent_counts(ref_server.model, rows)
    assert manifest_counts(result.manifest) == want
    assert sum(record_counts(run_dir), Counter()) == want
    verified(cfg)


def test_reader_refuses_a_manifest_without_capture_facts(tmp_path: Path, ref_server: RefServer) -> None:
    from hsx_extractor.storage.manifest import Capture, ManifestError

    cfg = base_config(tmp_path, ref_server, write_jsonl(tmp_path / "d.jsonl", chat_rows(3)))
    assert run(cfg)[0] == EXIT_OK
    run_dir = tmp_path / "out" / "run"
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    recorded = Capture.from_json(manifest["capture"])
    # What hsx wrote before the capture facts existed.
    old = {k: v for k, v in manifest.items() if k not in {"capture", "tokenizer", "dataset", "tokenCounts"}}
    path.write_text(json.dumps({**old, "format": "hsx-manifest/1"}))
    with pytest.raises(ManifestError, match=r"lacks|no capture facts") as refused:
        OutputReader(str(run_dir))
    assert "capture.finalState" in str(refused.value) and "will not guess" in str(refused.value)
    stated = OutputReader(str(run_dir), capture=recorded)  # the caller states the convention
    assert stated.capture == recorded and len(stated) == 3
    # A statement contradicting a manifest that has the facts is refused too.
    path.write_text(json.dumps(manifest))
    pre_norm = dataclasses.replace(recorded, final_state="pre-norm")
    with pytest.raises(ManifestError, match="pre-norm"):
        OutputReader(str(run_dir), capture=pre_norm)
    cli = subprocess.run([*HSX, "vocab", str(run_dir), "--draft-vocab-size", "4", "--out", str(tmp_path / "v")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert cli.returncode == EXIT_OK, cli.stderr
    path.write_text(json.dumps({**old, "format": "hsx-manifest/1"}))
    cli = subprocess.run([*HSX, "vocab", str(run_dir), "--draft-vocab-size", "4"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert cli.returncode == EXIT_PERMANENT and "holds no token counts" in cli.stderr
