"""Real trainers' own loading code consumes ``hsx export`` output, values equal to what hsx stored.

The export runs here (this checkout's ``hsx export``, the project venv); the trainer's code runs in
the trainers venv (SpecForge 0.2.0, speculators 0.9.0, Model-Optimizer 0.47.0 from PyPI) through
tests/trainers/trainer_side.py, which writes what the trainer loaded back for comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.config import OutputSpec
from hsx_extractor.reader import OutputReader
from hsx_extractor.tools.cli import main as hsx
from tests.trainers.conftest import bits, run_trainer

pytestmark = pytest.mark.trainers


def stored(uri: str, output: OutputSpec | None = None) -> dict[int, Any]:
    """Every sample of the run as hsx's reader returns it, by dataset index."""
    reader = OutputReader(uri, output)
    return {rec.index: rec for rec in (reader.read(p) for p in range(len(reader)))}


def samples_of(loaded: dict[str, Any]) -> dict[int, int]:
    """dataset index -> the trainer's sample number."""
    return {int(v[0]): int(k.split(".")[0]) for k, v in loaded.items() if k.endswith(".index")}


@pytest.mark.s3
def test_specforge_trains_on_an_s3_extraction(
    s3_run: tuple[str, OutputSpec], trainers_python: Path, tmp_path: Path, s3_env: Any
) -> None:
    uri, output = s3_run
    dest = tmp_path / "specforge"
    assert hsx(["export", "--to", "specforge", uri, str(dest)]) == 0
    loaded = run_trainer(trainers_python, "specforge", dest, tmp_path / "sf.safetensors")
    want = stored(uri, output)
    got = samples_of(loaded)
    assert sorted(got) == sorted(want) and 3 not in got  # the malformed row stays quarantined
    for index, n in got.items():
        rec = want[index]
        assert loaded[f"{n}.input_ids"].tolist() == [rec.input_ids.tolist()]
        # SpecForge's own normaliser zeroes the last position's mask (no next token); the rest is hsx's.
        mask = rec.loss_mask.astype(np.int64)
        mask[-1] = 0
        assert loaded[f"{n}.loss_mask"].tolist() == [mask.tolist()]
        assert rec.loss_mask[:-1].any()
        assert np.array_equal(bits(loaded[f"{n}.hidden_state"][0]), rec.aux_hidden_states)  # EAGLE-3 input
        assert np.array_equal(bits(loaded[f"{n}.target"][0]), rec.hidden_states)  # post-norm, as stored
    lengths = sorted(len(r.input_ids) for r in want.values())
    assert loaded["batch.input_ids"].shape[0] == 2 and loaded["batch.loss_mask"].shape[1] >= lengths[0]


def test_specforge_trains_a_draft_one_step_on_cpu(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    dest = tmp_path / "specforge"
    model = prenorm_run["model"]
    assert hsx(["export", "--to", "specforge", prenorm_run["uri"], str(dest), "--model", str(model)]) == 0
    out = run_trainer(
        trainers_python, "specforge-step", dest, tmp_path / "step.safetensors", 512, verifier=model
    )
    losses = out["losses"]
    assert bool(torch.isfinite(losses).all()) and float(losses[0]) > 0
    assert float(losses[1]) < float(losses[0])
    # the teacher is the target's own lm_head over the exported (post-norm) state
    # (SpecForge loads it in its training dtype)
    lm_head = load_file(str(model / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(out["head"], lm_head.to(out["head"].dtype))


def test_speculators_reads_a_pre_norm_run(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "speculators"
    assert hsx(["export", "--to", "speculators", prenorm_run["uri"], str(dest)]) == 0
    loaded = run_trainer(trainers_python, "speculators", dest, tmp_path / "sp.safetensors", max_len=512)
    want = stored(prenorm_run["uri"])
    got = samples_of(loaded)
    assert sorted(got) == sorted(want) == list(range(5))
    for index, n in got.items():
        rec = want[index]
        assert loaded[f"{n}.input_ids"].tolist() == rec.input_ids.tolist()
        assert loaded[f"{n}.loss_mask"].tolist() == rec.loss_mask.tolist()
        assert np.array_equal(bits(loaded[f"{n}.hidden_states"]), rec.aux_hidden_states)
        # pre-norm as stored: speculators applies the verifier's norm itself
        assert np.array_equal(bits(loaded[f"{n}.verifier_last_hidden_states"]), rec.hidden_states)
    # speculators' collate packs the shifted samples into one row of max_len
    total = sum(len(r.input_ids) - 1 for r in want.values())
    doc = loaded["batch.document_ids"][0]
    assert int((doc >= 0).sum()) == total and int(doc.max()) == 4
    first = want[0]
    assert loaded["batch.input_ids"][0, : len(first.input_ids) - 1].tolist() == first.input_ids[1:].tolist()


def test_speculators_trains_a_draft_one_step_on_cpu(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    dest = tmp_path / "speculators"
    assert hsx(["export", "--to", "speculators", prenorm_run["uri"], str(dest)]) == 0
    out = run_trainer(trainers_python, "speculators-step", dest, tmp_path / "step.safetensors", 512,
                      verifier=prenorm_run["model"])  # fmt: skip
    losses = out["losses"]
    assert bool(torch.isfinite(losses).all()) and float(losses[0]) > 0 and float(out["fc_grad"][0]) > 0
    assert float(losses[1]) < float(losses[0])  # the step learned something from hsx's states
    # the norm speculators applies to the pre-norm states is the target model's own final norm
    model_norm = load_file(str(prenorm_run["model"] / "model.safetensors"))["model.norm.weight"].float()
    assert torch.equal(out["verifier_norm"], model_norm)
    assert out["target_layer_ids"].tolist() == list(OutputReader(prenorm_run["uri"]).capture.layer_ids)


def test_modelopt_reads_an_export_with_the_norm_applied(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "modelopt"
    code = hsx(
        ["export", "--to", "modelopt", prenorm_run["uri"], str(dest), "--model", str(prenorm_run["model"])]
    )
    assert code == 0
    loaded = run_trainer(trainers_python, "modelopt", dest, tmp_path / "mo.safetensors", max_len=64)
    want = stored(prenorm_run["uri"])
    got = samples_of(loaded)
    assert sorted(got) == list(range(5))
    for index, n in got.items():
        rec = want[index]
        assert loaded[f"{n}.input_ids"].tolist() == rec.input_ids.tolist()
        assert loaded[f"{n}.loss_mask"].tolist() == rec.loss_mask.tolist()  # answer_only_loss: hsx's mask
        assert loaded[f"{n}.labels"][:-1].tolist() == rec.input_ids[1:].tolist()
        assert np.array_equal(bits(loaded[f"{n}.aux_hidden_states"]), rec.aux_hidden_states)
        # the model's own final norm of the stored pre-norm state, and Model-Optimizer told it is post-norm
        assert np.array_equal(bits(loaded[f"{n}.base_model_hidden_states"]), prenorm_run["post_norm"][index])
        assert int(loaded[f"{n}.prenorm"][0]) == 0
    assert tuple(loaded["batch.aux_hidden_states"].shape[:2]) == (2, 64)
