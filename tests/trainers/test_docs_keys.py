"""The trainer settings docs/training.md tells users to write are settings the trainers have: every
`model.x` / `data.x` / `training.x` it names, against the trainer named last before it, is a field of
SpecForge's own config schema or a key of Model-Optimizer's own EAGLE-3 recipe (checked in the
trainers' venv). A wrong key costs a user a failed launch on a GPU node (SpecForge rejects unknown keys)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
TRAINERS = {"SpecForge": "specforge", "Model-Optimizer": "modelopt", "speculators": "speculators"}
# Written in the doc as module paths of the model, not as trainer settings.
NOT_SETTINGS = {"model.norm"}

CHECK = r"""
import json, sys
import yaml
from importlib.resources import files
from specforge.config.schema import Config
keys = json.loads(sys.argv[1])
sections = {name: field.annotation for name, field in Config.model_fields.items()}
recipe = yaml.safe_load(files("modelopt_recipes").joinpath("general/speculative_decoding/eagle3.yaml").read_text())
missing = []
for trainer, key in keys:
    section, name = key.split(".")
    if trainer == "specforge":
        model = sections.get(section)
        ok = model is not None and name in model.model_fields
    else:
        ok = name in (recipe.get(section) or {})
    if not ok:
        missing.append(f"{trainer}: {key}")
print(json.dumps(missing))
"""


def named_settings(text: str) -> list[tuple[str, str]]:
    """``(trainer, key)`` for each backticked setting, the trainer being the last one named before it."""
    found: list[tuple[str, str]] = []
    pattern = re.compile(r"(SpecForge|Model-Optimizer|speculators)|`((?:model|data|training)\.[a-z_]+)[`:= ]")
    trainer = ""
    for match in pattern.finditer(text):
        if match.group(1):
            trainer = TRAINERS[match.group(1)]
        elif match.group(2) not in NOT_SETTINGS:
            found.append((trainer, match.group(2)))
    return found


def test_the_doc_names_its_settings_with_their_trainer() -> None:
    keys = named_settings(DOC.read_text())
    assert ("specforge", "model.vocab_mapping_path") in keys and ("modelopt", "data.draft_vocab_cache") in keys
    assert ("specforge", "data.vocab_mapping_path") not in keys  # SpecForge 0.2 rejects it
    assert all(trainer in ("specforge", "modelopt") for trainer, _ in keys), keys


@pytest.mark.trainers
def test_every_setting_the_doc_names_exists_in_its_trainer(trainers_python: Path) -> None:
    keys = sorted(set(named_settings(DOC.read_text())))
    done = subprocess.run([str(trainers_python), "-c", CHECK, json.dumps(keys)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], done.stdout
    # The checker itself can fail: a setting SpecForge does not have is reported.
    bad = subprocess.run([str(trainers_python), "-c", CHECK, json.dumps([["specforge", "data.vocab_mapping_path"]])],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert json.loads(bad.stdout.strip().splitlines()[-1]) == ["specforge: data.vocab_mapping_path"], bad.stderr
