"""Training from the run in place, no second copy of the hidden states (issue 35 item 5).

``hsx export --in-place`` writes only launch files (and speculators' row table); each trainer's own loading
code then reads the run through hsx_extractor.in_place, in the trainers venv. What the trainer gets must be
exactly what it gets from a copied export of the same run, tensor for tensor, after its own normaliser and
collator; and the trainers' command lines train from it.
"""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx_extractor.config import OutputSpec
from hsx_extractor.contract import EXIT_PERMANENT
from hsx_extractor.tools.cli import main as hsx
from hsx_extractor.tools.export import EXPORT_RECORD, ExportError, open_in_place
from tests.trainers.conftest import EXTRACTOR, run_trainer
from tests.trainers.test_trainer_clis import CPU_SWITCHES, _export, _run_cli

pytestmark = pytest.mark.trainers


def hidden_files(dest: Path) -> list[str]:
    return sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.suffix in (".ckpt", ".pt", ".safetensors"))


def same_tensors(copied: dict[str, Any], in_place: dict[str, Any]) -> None:
    assert sorted(copied) == sorted(in_place)
    assert any(k.endswith(".index") for k in copied)
    for key, value in copied.items():
        assert in_place[key].dtype == value.dtype and torch.equal(in_place[key], value), key


@pytest.mark.s3
def test_specforge_reads_an_s3_run_in_place_as_from_a_copy(
    s3_run: tuple[str, OutputSpec], trainers_python: Path, tmp_path: Path, s3_env: Any
) -> None:
    uri, _ = s3_run
    copied, in_place = tmp_path / "copied", tmp_path / "in-place"
    assert hsx(["export", "--to", "specforge", uri, str(copied)]) == 0
    assert hsx(["export", "--to", "specforge", "--in-place", uri, str(in_place)]) == 0
    record = json.loads((in_place / EXPORT_RECORD).read_text())
    assert record["inPlace"] and record["samples"] == 6 and hidden_files(in_place) == []
    assert json.loads((in_place / "specforge.json").read_text())["data"]["hidden_states_path"] == f"hsx:{in_place}"
    assert record["launch"]["command"].startswith("python -m hsx_extractor.in_place specforge train -c ")
    want = run_trainer(trainers_python, "specforge", copied, tmp_path / "copied.safetensors")
    got = run_trainer(trainers_python, "specforge-in-place", in_place, tmp_path / "in-place.safetensors",
                      env=s3_env.env())  # fmt: skip
    same_tensors(want, got)


def test_speculators_and_modelopt_read_a_run_in_place_as_from_a_copy(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    uri, model = prenorm_run["uri"], str(prenorm_run["model"])
    for trainer, extra in (("speculators", []), ("modelopt", ["--model", model])):  # modelopt: norm applied on read
        copied, in_place = tmp_path / f"{trainer}-copied", tmp_path / f"{trainer}-in-place"
        assert hsx(["export", "--to", trainer, uri, str(copied), *extra]) == 0
        assert hsx(["export", "--to", trainer, "--in-place", uri, str(in_place), *extra]) == 0
        assert hidden_files(in_place) == [] and hidden_files(copied) != []
        want = run_trainer(trainers_python, trainer, copied, tmp_path / f"{trainer}-copied.safetensors")
        got = run_trainer(trainers_python, f"{trainer}-in-place", in_place, tmp_path / f"{trainer}-in-place.safetensors")
        same_tensors(want, got)
    record = json.loads((tmp_path / "modelopt-in-place" / EXPORT_RECORD).read_text())
    assert record["finalNormModelDir"] == str(Path(model).resolve()) and record["finalNormModel"] == "same norm"
    args = (tmp_path / "speculators-in-place" / "speculators.args").read_text().split()
    assert args[args.index("--hidden-states-backend") + 1] == "hsx"


def test_in_place_refuses_what_a_copy_refuses_and_a_run_that_changed(
    prenorm_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = prenorm_run["uri"]
    # A pre-norm run for SpecForge needs the model's norm, in place as in a copy.
    assert hsx(["export", "--to", "specforge", "--in-place", uri, str(tmp_path / "sf")]) == EXIT_PERMANENT
    assert "--model DIR" in capsys.readouterr().err
    dest = tmp_path / "spec"
    assert hsx(["export", "--to", "speculators", "--in-place", uri, str(dest)]) == 0
    with pytest.raises(ExportError, match="made for speculators, not modelopt"):
        open_in_place(dest, "modelopt")
    record = json.loads((dest / EXPORT_RECORD).read_text())
    (dest / EXPORT_RECORD).write_text(json.dumps({**record, "samples": record["samples"] + 1}))
    with pytest.raises(ExportError, match="is not the run"):
        open_in_place(dest, "speculators")
    copied = tmp_path / "copied"
    assert hsx(["export", "--to", "speculators", uri, str(copied)]) == 0
    with pytest.raises(ExportError, match="a copied export, not an in-place one"):
        open_in_place(copied, "speculators")


def _in_place_cli(trainers_python: Path, argv: list[str], home: Path) -> str:
    """The printed ``python -m hsx_extractor.in_place ...`` command, with hsx on PYTHONPATH beside the CPU shim."""
    assert argv[:3] == ["python", "-m", "hsx_extractor.in_place"], argv
    return _run_cli(trainers_python, argv, home, pythonpath=[str(EXTRACTOR)])


def test_specforge_cli_trains_in_place_and_plans_its_ranks_through_hsx(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "specforge"
    argv = _export(prenorm_run, "specforge", dest, "--in-place", "--model", str(prenorm_run["model"]))
    assert hidden_files(dest) == []
    output = _in_place_cli(trainers_python, [*argv, *CPU_SWITCHES["specforge"], "training.num_epochs=2",
                                             "training.log_interval=1"], tmp_path)  # fmt: skip
    steps = [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", output, re.M)]
    assert len(steps) >= 4, output[-3000:]
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps), [s["loss"] for s in steps]
    trained = Path(json.loads((dest / "specforge.json").read_text())["output_dir"])
    assert any(trained.rglob("*.safetensors")) or any(trained.rglob("*.pt")), sorted(trained.rglob("*"))
    # Two ranks: SpecForge's own launch plan starts each through hsx's launcher, so each has the same routes.
    plan = _in_place_cli(trainers_python, [*argv, *CPU_SWITCHES["specforge"], "deployment.trainer.nproc_per_node=2",
                                           "--plan"], tmp_path)  # fmt: skip
    (command,) = json.loads(plan[plan.index("{") :])["commands"]
    argv = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(command["argv"]))
    assert argv.startswith("python -m torch.distributed.run --no-python "), argv
    assert " -m hsx_extractor.in_place specforge train --config " in argv and "--nproc_per_node 2" in argv, argv


def test_speculators_cli_trains_in_place(prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path) -> None:
    dest = tmp_path / "speculators"
    argv = _export(prenorm_run, "speculators", dest, "--in-place", "--target-model", str(prenorm_run["model"]))
    assert hidden_files(dest) == []
    saved = tmp_path / "drafter"
    _in_place_cli(trainers_python, [*argv, *CPU_SWITCHES["speculators"], "--epochs", "1", "--save-path", str(saved)],
                  tmp_path)  # fmt: skip
    metrics = json.loads((saved / "0" / "val_metrics.json").read_text())
    assert math.isfinite(metrics["loss_epoch"]) and metrics["loss_epoch"] > 0, metrics
    assert (saved / "0" / "model.safetensors").stat().st_size > 0


def test_an_in_place_export_of_a_relative_path_opens_from_anywhere(
    prenorm_run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Model-Optimizer's launcher runs from its own checkout: the record names the run absolutely.
    run = Path(prenorm_run["uri"])
    monkeypatch.chdir(run.parent.parent)  # hsx refuses '..' in a local path: a plain relative one
    dest = tmp_path / "dest"
    assert hsx(["export", "--to", "speculators", "--in-place", f"{run.parent.name}/{run.name}", str(dest)]) == 0
    assert json.loads((dest / EXPORT_RECORD).read_text())["source"] == str(run.resolve())
    monkeypatch.chdir("/")
    assert len(open_in_place(dest, "speculators")) == 5
