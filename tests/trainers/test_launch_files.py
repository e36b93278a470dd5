"""``hsx export --to X`` writes trainer X's launch file with the run's facts filled in, and each trainer's
own config loader accepts it (SpecForge's ``load_config``, speculators' ``TrainConfig.resolve``,
Model-Optimizer's EAGLE-3 recipe keys); speculators finds the draft vocabulary in its data folder."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.tools.cli import main as hsx
from hsx_extractor.tools.export import EXPORT_RECORD
from hsx_extractor.tools.trainer_launch import SPECFORGE_DRAFT_CONFIG
from hsx_extractor.tools.vocab import write_vocab

HERE = Path(__file__).resolve().parent
DRAFT = 16

pytestmark = pytest.mark.trainers


def test_each_trainers_own_loader_accepts_the_launch_file(
    prenorm_run: dict[str, Any], trainers_python: Path, tmp_path: Path, capsys: Any
) -> None:
    model = prenorm_run["model"]
    vocab = tmp_path / "vocab"
    target_size = json.loads((model / "config.json").read_text())["vocab_size"]
    write_vocab(prenorm_run["uri"], DRAFT, vocab, target_size=target_size)
    dests = {t: tmp_path / t for t in ("specforge", "speculators", "modelopt")}
    for trainer, dest in dests.items():
        norm = ["--model", str(model)] if trainer != "speculators" else ["--target-model", str(model)]
        assert hsx(["export", "--to", trainer, prenorm_run["uri"], str(dest), *norm, "--vocab", str(vocab)]) == 0
        out = capsys.readouterr().out
        record = json.loads((dest / EXPORT_RECORD).read_text())
        assert f"train with: {record['launch']['command']}" in out, out
    assert (dests["speculators"] / f"d2t-{DRAFT}.npy").is_file() and (dests["speculators"] / "token_freq.pt").is_file()
    assert np.array_equal(np.load(dests["speculators"] / f"t2d-{DRAFT}.npy"), np.load(vocab / "t2d.npy"))
    # SpecForge's draft config carries the draft vocabulary's size (its generated default assumes 32000).
    draft = json.loads((dests["specforge"] / SPECFORGE_DRAFT_CONFIG).read_text())
    assert draft["draft_vocab_size"] == DRAFT and draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert json.loads((dests["specforge"] / "specforge.json").read_text())["model"]["draft_model_config"] == str(
        (dests["specforge"] / SPECFORGE_DRAFT_CONFIG).resolve()
    )

    done = subprocess.run([str(trainers_python), str(HERE / "launch_side.py"), *map(str, dests.values())],
                          capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    layers = json.loads((dests["specforge"] / EXPORT_RECORD).read_text())["layerIds"]
    sf, sp, mo = loaded["specforge"], loaded["speculators"], loaded["modelopt"]
    assert sf == {"hidden_states_path": str(dests["specforge"].resolve()), "layers": layers, "max_length": 2048,
                  "vocab_mapping_path": str((vocab / "vocab_mapping.pt").resolve()), "target": str(model)}  # fmt: skip
    assert sp == {"data_path": str(dests["speculators"].resolve()), "layers": layers, "draft_vocab_size": DRAFT,
                  "on_missing": "raise", "verifier": str(model)}  # fmt: skip
    assert mo["unknown"] == [] and mo["overrides"]["data.offline_data_path"] == str(dests["modelopt"].resolve())
    assert mo["overrides"]["data.draft_vocab_cache"] == str((vocab / "d2t.pt").resolve())
    # Model-Optimizer numbers layer outputs: the input of layer j is the output of layer j - 1.
    outputs = mo["overrides"]["eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids"]
    assert outputs == [j - 1 for j in layers]
    record = json.loads((dests["modelopt"] / EXPORT_RECORD).read_text())
    assert record["trainerLayerIds"] == {"specforge": layers, "speculators": layers, "modelopt": outputs}


def test_a_vocab_folder_that_is_not_hsx_vocabs_is_refused_before_any_data(
    prenorm_run: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    dest = tmp_path / "sp"
    code = hsx(["export", "--to", "speculators", prenorm_run["uri"], str(dest), "--vocab", str(tmp_path / "nothing")])
    assert code != 0 and "run `hsx vocab` first" in capsys.readouterr().err
    assert not dest.exists() or not any(dest.iterdir())
