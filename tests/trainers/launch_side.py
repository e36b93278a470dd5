"""Run in the trainers' venv: each trainer's own config loader accepts the launch file `hsx export` wrote.
Usage: launch_side.py SPECFORGE_DEST SPECULATORS_DEST MODELOPT_DEST; prints one JSON line of what each loaded."""

import json
import sys
from importlib.resources import files
from pathlib import Path

import yaml
from specforge.config.schema import load_config
from speculators.train.config import TrainConfig


def main(specforge: str, speculators: str, modelopt: str) -> None:
    sf = load_config(str(Path(specforge) / "specforge.json"))  # SpecForge's own loader (strict schema)
    argv = (Path(speculators) / "speculators.args").read_text().split("\n")
    sp = TrainConfig.resolve([a for a in argv if a])  # speculators' own CLI resolution; exits 2 on any error
    recipe = yaml.safe_load(files("modelopt_recipes").joinpath("general/speculative_decoding/eagle3.yaml").read_text())
    unknown = []
    mo = {}
    from modelopt.torch.speculative.eagle.default_config import default_eagle_config

    for line in (Path(modelopt) / "modelopt.overrides").read_text().splitlines():
        key, value = line.split("=", 1)
        section, name, *inner = key.split(".")
        # eagle_architecture_config is {} in the recipe: "overwrite to" Model-Optimizer's default_config.py
        known = default_eagle_config if name == "eagle_architecture_config" else (recipe.get(section) or {})
        if (inner[0] if inner else name) not in known or (inner and name not in (recipe.get(section) or {})):
            unknown.append(key)
        mo[key] = yaml.safe_load(value) if value.startswith("[") else value
    print(json.dumps({
        "specforge": {"hidden_states_path": sf.data.hidden_states_path, "vocab_mapping_path": sf.model.vocab_mapping_path,
                      "layers": sf.model.aux_hidden_state_layer_ids, "max_length": sf.data.max_length,
                      "target": sf.model.target_model_path},
        "speculators": {"data_path": sp.data.data_path, "layers": sp.draft.target_layer_ids,
                        "draft_vocab_size": sp.draft.draft_vocab_size, "on_missing": sp.generation.on_missing,
                        "verifier": sp.verifier.verifier_name_or_path},
        "modelopt": {"overrides": mo, "unknown": unknown},
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
