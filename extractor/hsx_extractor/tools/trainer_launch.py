"""What ``hsx export --to X`` writes next to the data so that trainer X starts without hand-editing:
its settings filled in from the run (paths, layer ids, sequence length, draft vocabulary) and the
command to run (docs/training.md). Pure: the files' contents from the export record.

* SpecForge 0.2: ``specforge.json``, a ``specforge train -c`` config (its ``Config`` schema).
* speculators 0.9: ``speculators.args``, the ``speculators train`` flags one per line, and the draft
  vocabulary copied into the data folder under the size-keyed names it finds there without flags.
* Model-Optimizer 0.47: ``modelopt.overrides``, dotlist overrides of its EAGLE-3 recipe
  (``modelopt_recipes/general/speculative_decoding/eagle3.yaml``) for its offline launcher.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_extractor.tools.vocab import D2T_FILE as VOCAB_D2T_NPY
from hsx_extractor.tools.vocab import FREQ_FILE as VOCAB_FREQ
from hsx_extractor.tools.vocab import MAPPING_FILE as VOCAB_MAPPING
from hsx_extractor.tools.vocab import MODELOPT_D2T_FILE as VOCAB_D2T_PT
from hsx_extractor.tools.vocab import T2D_FILE as VOCAB_T2D_NPY

SPECFORGE_CONFIG = "specforge.json"
SPECULATORS_ARGS = "speculators.args"
MODELOPT_OVERRIDES = "modelopt.overrides"
class LaunchError(ValueError):
    """The export cannot say how to launch the trainer (a vocabulary folder that is not hsx vocab's)."""


@dataclass(frozen=True)
class Launch:
    files: dict[str, str]  # file name in the export folder -> text
    command: str  # what to run, as a user copies it
    notes: tuple[str, ...] = ()


def draft_vocab_size(vocab_dir: Path) -> int:
    """N, the number of draft tokens of an ``hsx vocab`` folder (the length of its d2t)."""
    import numpy as np

    path = vocab_dir / VOCAB_D2T_NPY
    try:
        d2t = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise LaunchError(f"--vocab {vocab_dir}: no readable {VOCAB_D2T_NPY} (run `hsx vocab` first): {exc}") from None
    if d2t.ndim != 1 or d2t.size == 0:
        raise LaunchError(f"{path}: expected a 1-D array of draft-token offsets, got shape {d2t.shape}")
    return int(d2t.size)


def launch(
    trainer: str, record: dict[str, Any], dest: Path, target_model: str, max_length: int | None, vocab: Path | None
) -> Launch:
    """The launch files and command for ``trainer`` over the export at ``dest`` (absolute paths)."""
    data = str(dest.resolve())
    layers = [int(i) for i in record["layerIds"]]
    size = draft_vocab_size(vocab) if vocab is not None else None
    if trainer == "specforge":
        model: dict[str, Any] = {"target_model_path": target_model, "aux_hidden_state_layer_ids": layers}
        if vocab is not None:
            model["vocab_mapping_path"] = str((vocab / VOCAB_MAPPING).resolve())
        config = {
            "model": model,
            "data": {"hidden_states_path": data, **({"max_length": max_length} if max_length else {})},
            "output_dir": str(dest.resolve().parent / f"{dest.name}-draft"),
        }
        notes = (f"the draft config's draft_vocab_size must be {size}",) if size else ()
        path = dest.resolve() / SPECFORGE_CONFIG
        return Launch({SPECFORGE_CONFIG: json.dumps(config, indent=2) + "\n"}, f"specforge train -c {path}", notes)
    if trainer == "speculators":
        args = ["--verifier-name-or-path", target_model, "--data-path", data, "--on-missing", "raise"]
        args += ["--target-layer-ids", *map(str, layers)]
        if max_length:
            args += ["--total-seq-len", str(max_length)]
        if size:
            args += ["--draft-vocab-size", str(size)]
        path = dest.resolve() / SPECULATORS_ARGS
        return Launch({SPECULATORS_ARGS: "\n".join(args) + "\n"}, f"speculators train $(cat {shlex.quote(str(path))})")
    if trainer == "modelopt":
        overrides = [f"model.model_name_or_path={target_model}", f"data.offline_data_path={data}",
                     "training.answer_only_loss=true"]  # fmt: skip
        if vocab is not None:
            overrides.append(f"data.draft_vocab_cache={(vocab / VOCAB_D2T_PT).resolve()}")
        if max_length:
            overrides.append(f"training.training_seq_len={max_length}")
        notes = (f"the EAGLE config's draft_vocab_size must be {size}",) if size else ()
        path = dest.resolve() / MODELOPT_OVERRIDES
        return Launch(
            {MODELOPT_OVERRIDES: "\n".join(overrides) + "\n"},
            f"Model-Optimizer's examples/speculative_decoding launcher with the eagle3 recipe and $(cat {path})",
            notes,
        )
    raise LaunchError(f"no launch files for trainer {trainer!r}")


def place_vocab(trainer: str, vocab: Path, dest: Path) -> list[str]:
    """Copy the draft vocabulary where ``trainer`` finds it without flags (speculators: in its data
    folder as ``d2t-{N}.npy``/``t2d-{N}.npy`` and ``token_freq.pt``); the names copied."""
    if trainer != "speculators":
        return []
    size = draft_vocab_size(vocab)
    placed = {VOCAB_D2T_NPY: f"d2t-{size}.npy", VOCAB_T2D_NPY: f"t2d-{size}.npy", VOCAB_FREQ: VOCAB_FREQ}
    for source, name in placed.items():
        if not (vocab / source).is_file():
            raise LaunchError(f"--vocab {vocab}: no {source} (run `hsx vocab` first)")
        shutil.copyfile(vocab / source, dest / name)
    return sorted(placed.values())
