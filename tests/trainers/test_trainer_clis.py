"""From an hsx export to a trained drafter checkpoint with each trainer's own command line (issue 35 item 1).

``hsx export --to X`` writes the launch file and prints the command; the test runs that command as a user
copies it (in the trainers venv), adding only the CPU switches docs/training.md lists and the CPU shim
(cpu_shim/sitecustomize.py). A few steps train on the tiny model's real hidden states; the loss is finite
and moves the weights, and the trainer writes a drafter checkpoint its own tools read.
Model-Optimizer's EAGLE-3 launcher lives in its repository's examples, not in its wheel: its training runs as that
launcher wires it (tests/trainers/trainer_side.py, ``modelopt_train``).
"""

from __future__ import annotations

import ast
import json
import math
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hsx_extractor.tools.cli import main as hsx
from hsx_extractor.tools.export import EXPORT_RECORD
from hsx_extractor.tools.trainer_launch import SPECFORGE_DRAFT_CONFIG
from hsx_extractor.tools.vocab import write_vocab
from tests.trainers.conftest import run_trainer

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.trainers

# What each CLI needs on CPU beyond the shim (docs/training.md, "Train on CPU").
CPU_SWITCHES = {
    # FSDP needs an accelerator; NO_SHARD makes SpecForge wrap the draft in DDP (gloo). Flex attention has no
    # CPU backward.
    "specforge": ["training.fsdp_sharding=NO_SHARD", "training.attention_backend=sdpa"],
    # The fused loss and flex attention are GPU kernels; no DataLoader worker processes in a test.
    "speculators": ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0"],
}


def _export(run: dict[str, Any], trainer: str, dest: Path, *extra: str) -> list[str]:
    """``hsx export --to trainer``; the command it prints, as argv."""
    assert hsx(["export", "--to", trainer, run["uri"], str(dest), *extra]) == 0
    record = json.loads((dest / EXPORT_RECORD).read_text())
    return shlex.split(record["launch"]["command"].replace("$(cat ", "").replace(")", ""))


def _run_cli(trainers_python: Path, argv: list[str], home: Path, pythonpath: list[str] | None = None) -> str:
    """``argv`` with its program from the trainers venv, the CPU shim on PYTHONPATH; stdout and stderr."""
    at = argv.index("speculators") if "speculators" in argv else -1
    if at >= 0 and argv[at + 1 : at + 2] == ["train"]:  # `$(cat FILE)`: the file's lines are the arguments
        argv = [*argv[: at + 2], *Path(argv[at + 2]).read_text().split(), *argv[at + 3 :]]
    path = ":".join([str(HERE / "cpu_shim"), *(pythonpath or [])])
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    done = subprocess.run([str(trainers_python.parent / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=600, env=env, cwd=home)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(argv[:3])} failed:\n{output[-6000:]}"
    return output


def test_specforge_train_cli_trains_a_drafter_from_the_export(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    model = prenorm_run["model"]
    dest = tmp_path / "specforge"
    # The whole target vocabulary as the draft's (the random tiny model's argmax rarely lands in a small one,
    # which would mask every position); a draft vocabulary's files are checked in test_launch_files.
    argv = _export(prenorm_run, "specforge", dest, "--model", str(model))
    assert argv[:3] == ["specforge", "train", "-c"]
    draft = json.loads((dest / SPECFORGE_DRAFT_CONFIG).read_text())
    assert draft["draft_vocab_size"] == json.loads((model / "config.json").read_text())["vocab_size"]
    output = _run_cli(trainers_python, [*argv, *CPU_SWITCHES["specforge"], "training.num_epochs=2",
                                        "training.log_interval=1"], tmp_path)  # fmt: skip
    steps = [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", output, re.M)]
    assert len(steps) >= 4, output[-3000:]
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps), [s["loss"] for s in steps]
    assert any(s["grad_norm"] > 0 for s in steps)
    trained = json.loads((dest / "specforge.json").read_text())["output_dir"]
    # The drafter as a Hugging Face model directory, by SpecForge's own export (the frozen embedding from the target).
    hf = tmp_path / "drafter"
    _run_cli(trainers_python, ["specforge", "export", "--to", "hf", "--checkpoint", trained, "--draft-config",
                               str(dest / SPECFORGE_DRAFT_CONFIG), "--output-dir", str(hf), "--embedding-source",
                               str(model)], tmp_path)  # fmt: skip
    assert (hf / "model.safetensors").stat().st_size > 0
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_speculators_train_cli_trains_a_drafter_from_the_export(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    model = prenorm_run["model"]
    vocab = tmp_path / "vocab"
    write_vocab(prenorm_run["uri"], 16, vocab, target_size=json.loads((model / "config.json").read_text())["vocab_size"])
    dest = tmp_path / "speculators"
    argv = _export(prenorm_run, "speculators", dest, "--target-model", str(model), "--vocab", str(vocab))
    assert argv[:2] == ["speculators", "train"]
    saved = tmp_path / "drafter"
    _run_cli(trainers_python, [*argv, *CPU_SWITCHES["speculators"], "--epochs", "2", "--save-path", str(saved)],
             tmp_path)  # fmt: skip
    last = saved / "1"  # one folder per epoch
    assert (last / "model.safetensors").stat().st_size > 0 and (last / "config.json").is_file()
    metrics = json.loads((last / "val_metrics.json").read_text())
    assert math.isfinite(metrics["loss_epoch"]) and metrics["loss_epoch"] > 0, metrics
    first, second = (load_file(str(saved / epoch / "model.safetensors")) for epoch in ("0", "1"))
    assert any(not torch.equal(first[k], second[k]) for k in first), "the second epoch changed no weight"
    assert json.loads((last / "config.json").read_text())["draft_vocab_size"] == 16


def test_modelopt_trains_a_drafter_from_the_export_and_in_place(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path
) -> None:
    """Model-Optimizer's training as its launcher wires it (trainer_side.modelopt_train: the launcher itself is
    not in the wheel), from the overrides ``hsx export`` wrote, over the copied files and in place."""
    model = str(prenorm_run["model"])
    for mode, extra in (("modelopt-train", []), ("modelopt-train-in-place", ["--in-place"])):
        dest = tmp_path / mode
        assert hsx(["export", "--to", "modelopt", "--model", model, *extra, prenorm_run["uri"], str(dest)]) == 0
        command = json.loads((dest / EXPORT_RECORD).read_text())["launch"]["command"]
        assert command.startswith("python examples/speculative_decoding/main.py --config general/speculative_decoding/eagle3 $(cat ")
        got = run_trainer(trainers_python, mode, dest, tmp_path / f"{mode}.safetensors", max_len=64)
        losses = got["losses"].tolist()
        assert len(losses) >= 10 and all(math.isfinite(x) and x > 0 for x in losses), losses
        assert losses[-1] < losses[0], losses  # 3 epochs over 5 samples at lr 1e-3: the draft learns
        assert int(got["saved_bytes"][0]) > 0
