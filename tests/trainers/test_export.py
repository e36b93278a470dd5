"""``hsx export``: the final-norm convention converted or refused, never silently wrong (no trainer venv needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx_extractor.reader import OutputReader
from hsx_extractor.storage.layout import MANIFEST_NAME
from hsx_extractor.storage.manifest import Capture
from hsx_extractor.tools.cli import main as hsx
from hsx_extractor.tools.export import EXPORT_RECORD, ExportError, export
from hsx_extractor.tools.final_norm import FinalNormError, load_final_norm
from tests.storage.samples import CAPTURE
from tests.trainers.conftest import bits


def test_pre_norm_states_get_the_models_own_final_norm(prenorm_run: dict[str, Any], tmp_path: Path) -> None:
    dest = tmp_path / "sf"
    assert (
        hsx(
            [
                "export",
                "--to",
                "specforge",
                prenorm_run["uri"],
                str(dest),
                "--model",
                str(prenorm_run["model"]),
            ]
        )
        == 0
    )
    reader = OutputReader(prenorm_run["uri"])
    files = sorted(dest.rglob("*.ckpt"))
    assert len(files) == len(reader) == 5
    for path in files:
        index = int(path.stem.split("_")[1])
        saved = torch.load(path, weights_only=True)
        got = bits(saved["hidden_state"][0])
        assert np.array_equal(got, prenorm_run["post_norm"][index])  # bit for bit the model's own norm
        pre = reader.read(index).hidden_states
        assert not np.array_equal(got, pre)  # and the norm changed the values (the test can fail)
    record = json.loads((dest / EXPORT_RECORD).read_text())
    assert record["sourceFinalState"] == "pre-norm" and record["finalState"] == "post-norm"
    assert record["finalNormApplied"] == "model.safetensors:model.norm.weight"


def relabelled(run: dict[str, Any], tmp_path: Path, capture: dict[str, Any] | None) -> tuple[str, Path]:
    """A copy of the run whose manifest's ``capture`` is ``capture`` (None: no capture record)."""
    import shutil

    copy = tmp_path / "out"
    shutil.copytree(Path(run["uri"]).parent, copy)
    manifest = copy / "pre" / MANIFEST_NAME
    body = json.loads(manifest.read_text())
    body.pop("capture", None)
    if capture is not None:
        body["capture"] = capture
    manifest.write_text(json.dumps(body))
    return str(copy / "pre"), manifest


def test_post_norm_to_a_pre_norm_trainer_is_refused(
    prenorm_run: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    uri, _ = relabelled(prenorm_run, tmp_path, {**CAPTURE, "finalState": "post-norm"})
    dest = tmp_path / "sp"
    assert hsx(["export", "--to", "speculators", uri, str(dest), "--model", str(prenorm_run["model"])]) != 0
    assert "would apply the norm twice" in capsys.readouterr().err
    assert not dest.exists() or not any(dest.iterdir())


def test_pre_norm_to_a_post_norm_trainer_needs_the_model(
    prenorm_run: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    for trainer in ("specforge", "modelopt"):
        assert hsx(["export", "--to", trainer, prenorm_run["uri"], str(tmp_path / trainer)]) != 0
        assert "pass --model DIR" in capsys.readouterr().err


def test_an_unrecorded_convention_is_not_guessed(
    prenorm_run: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    uri, manifest = relabelled(prenorm_run, tmp_path, None)
    assert hsx(["export", "--to", "speculators", uri, str(tmp_path / "a")]) != 0
    assert "will not guess" in capsys.readouterr().err
    # a caller may state what an old run holds...
    stated = Capture.from_json({**CAPTURE, "layerIds": [2, 4, 5], "finalState": "pre-norm"})
    export(uri, "speculators", tmp_path / "b", capture=stated)
    assert len(list((tmp_path / "b" / "hidden_states").glob("hs_*.safetensors"))) == 5
    # ...but never against what a manifest records
    body = json.loads(manifest.read_text())
    body["capture"] = {**CAPTURE, "finalState": "post-norm"}
    manifest.write_text(json.dumps(body))
    with pytest.raises(ExportError, match="the caller stated"):
        export(uri, "speculators", tmp_path / "c", capture=stated)


def test_an_unknown_final_state_in_the_manifest_is_refused(
    prenorm_run: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    uri, _ = relabelled(prenorm_run, tmp_path, {**CAPTURE, "finalState": "normed"})
    assert hsx(["export", "--to", "modelopt", uri, str(tmp_path / "a")]) != 0
    assert "capture.finalState 'normed' is not one of" in capsys.readouterr().err


def test_destination_must_be_new_or_empty(prenorm_run: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    dest = tmp_path / "d"
    dest.mkdir()
    (dest / "old.pt").write_bytes(b"x")
    assert hsx(["export", "--to", "speculators", prenorm_run["uri"], str(dest)]) != 0
    assert "not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in dest.iterdir()) == ["old.pt"]


def test_final_norm_refuses_what_it_cannot_apply_exactly(norm_model: Path, tmp_path: Path) -> None:
    with pytest.raises(FinalNormError, match="hidden size"):
        load_final_norm(norm_model, 128)
    config = json.loads((norm_model / "config.json").read_text())
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(FinalNormError, match="plain RMSNorm"):
        load_final_norm(gemma, config["hidden_size"])


def other_norm_model(model: Path, tmp_path: Path) -> Path:
    """A copy of ``model`` whose final-norm weight differs (as a base model's does from its instruct variant's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-model"
    shutil.copytree(model, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    return other


def test_the_norm_of_another_model_is_refused_unless_overridden(
    prenorm_run: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    other = other_norm_model(prenorm_run["model"], tmp_path)
    dest = tmp_path / "mo"
    assert hsx(["export", "--to", "modelopt", prenorm_run["uri"], str(dest), "--model", str(other)]) != 0
    err = capsys.readouterr().err
    assert "is not the model this run was captured with: its final norm weight differ" in err, err
    assert not dest.exists() or not any(dest.iterdir())
    record = export(prenorm_run["uri"], "modelopt", tmp_path / "forced", model_dir=str(other), any_model=True)
    assert record["finalNormModel"] == "different final norm weight (--any-model)"
    same = export(prenorm_run["uri"], "modelopt", tmp_path / "same", model_dir=str(prenorm_run["model"]))
    assert same["finalNormModel"] == "same norm"


def test_a_run_without_a_norm_digest_falls_back_to_the_model_fingerprint(
    prenorm_run: dict[str, Any], tmp_path: Path
) -> None:
    from hsx_extractor.model import model_fingerprint

    uri, manifest = relabelled(prenorm_run, tmp_path, {**CAPTURE, "finalState": "pre-norm"})
    body = json.loads(manifest.read_text())
    body["run"] = {"model": "elsewhere"}  # a run from before the digest: nothing recorded
    manifest.write_text(json.dumps(body))
    model = str(prenorm_run["model"])
    with pytest.raises(ExportError, match="records neither its final norm nor its model"):
        export(uri, "specforge", tmp_path / "a", model_dir=model)
    body["run"]["modelFingerprint"] = model_fingerprint(model)
    manifest.write_text(json.dumps(body))
    assert export(uri, "specforge", tmp_path / "b", model_dir=model)["finalNormModel"] == "same model"
    body["run"]["modelFingerprint"] = {**body["run"]["modelFingerprint"], "configJson": "0" * 16}
    manifest.write_text(json.dumps(body))
    with pytest.raises(ExportError, match=r"its config\.json and weight index differ"):
        export(uri, "specforge", tmp_path / "c", model_dir=model)


def test_the_norm_digest_is_the_weights_own_bytes(prenorm_run: dict[str, Any], tmp_path: Path) -> None:
    import hashlib

    from safetensors.torch import load_file

    from hsx_extractor.model import final_norm_digest

    model = prenorm_run["model"]
    weight = load_file(str(model / "model.safetensors"))["model.norm.weight"]
    want = "sha256:" + hashlib.sha256(weight.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()[:32]
    assert final_norm_digest(model) == want
    assert final_norm_digest(other_norm_model(model, tmp_path)) != want
    assert final_norm_digest(tmp_path) is None and final_norm_digest(None) is None


def test_each_trainers_layer_numbering() -> None:
    """hsx, vLLM and speculators number layer inputs; Model-Optimizer numbers outputs, where the embeddings
    (capture layer 0, possible for DeepSeek-style ids) have no number: none is made up (-1 is its last layer)."""
    from hsx_extractor.tools.trainer_launch import trainer_layer_ids

    assert trainer_layer_ids([2, 16, 29]) == {"specforge": [2, 16, 29], "speculators": [2, 16, 29], "modelopt": [1, 15, 28]}
    assert trainer_layer_ids([0, 16, 29])["modelopt"] is None
