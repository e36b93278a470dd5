"""What ``hsx export --to X`` writes next to the data so that trainer X starts without hand-editing:
its settings filled in from the run (paths, layer ids, sequence length, draft vocabulary) and the
command to run (docs/training.md). Pure: the files' contents from the export record.

* SpecForge 0.2: ``specforge.json``, a ``specforge train -c`` config (its ``Config`` schema), and
  ``specforge-draft.json``, the one-layer EAGLE-3 draft's config with the draft vocabulary's size
  (SpecForge's generated default assumes 32000 draft tokens) when the target's config.json is readable.
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
SPECFORGE_DRAFT_CONFIG = "specforge-draft.json"
MODELOPT_RECIPE = "general/speculative_decoding/eagle3"  # Model-Optimizer's built-in EAGLE-3 recipe
# In place (``hsx export --in-place``): SpecForge's ``data.hidden_states_path`` names the export folder
# behind this prefix, speculators takes the hsx hidden-states backend, and both start through hsx's launcher.
IN_PLACE_PREFIX = "hsx:"
IN_PLACE_LAUNCHER = "python -m hsx_extractor.in_place"
SPECULATORS_BACKEND = "hsx"
# The target's config.json keys a draft layer shares with it (the Llama decoder layer's shape and rope).
DRAFT_SHARED_KEYS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
    "attention_dropout", "rope_theta", "rope_scaling", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


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


def specforge_draft_config(target: dict[str, Any], draft_vocab: int | None) -> dict[str, Any]:
    """SpecForge's EAGLE-3 draft (one Llama decoder layer) for ``target`` (its config.json, text part)."""
    text = target.get("text_config") or target
    shared = {k: text[k] for k in DRAFT_SHARED_KEYS if text.get(k) is not None}
    return {
        **shared,
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "draft_vocab_size": draft_vocab or int(text["vocab_size"]),
    }


def _target_config(target_model: str) -> dict[str, Any] | None:
    try:
        config = json.loads((Path(target_model) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # a path of the pods, not of this machine: the note says what to set
    return config if isinstance(config, dict) and "vocab_size" in (config.get("text_config") or config) else None


def trainer_layer_ids(layer_ids: list[int]) -> dict[str, list[int] | None]:
    """The capture layers in each trainer's numbering: hsx, vLLM and speculators number layer inputs (id j is
    Hugging Face ``hidden_states[j]``); Model-Optimizer numbers layer outputs (the output of layer j-1), so the
    embeddings (capture layer 0) have no number there (None)."""
    outputs = [j - 1 for j in layer_ids] if min(layer_ids, default=1) >= 1 else None
    return {"specforge": list(layer_ids), "speculators": list(layer_ids), "modelopt": outputs}


def launch(
    trainer: str, record: dict[str, Any], dest: Path, target_model: str, max_length: int | None, vocab: Path | None
) -> Launch:
    """The launch files and command for ``trainer`` over the export at ``dest`` (absolute paths)."""
    data = str(dest.resolve())
    in_place = bool(record.get("inPlace"))
    launcher = f"{IN_PLACE_LAUNCHER} " if in_place else ""
    layers = [int(i) for i in record["layerIds"]]
    size = draft_vocab_size(vocab) if vocab is not None else None
    if trainer == "specforge":
        model: dict[str, Any] = {"target_model_path": target_model, "aux_hidden_state_layer_ids": layers}
        if vocab is not None:
            model["vocab_mapping_path"] = str((vocab / VOCAB_MAPPING).resolve())
        files: dict[str, str] = {}
        notes: tuple[str, ...] = ()
        target = _target_config(target_model)
        if target is not None:
            model["draft_model_config"] = str(dest.resolve() / SPECFORGE_DRAFT_CONFIG)
            files[SPECFORGE_DRAFT_CONFIG] = json.dumps(specforge_draft_config(target, size), indent=2) + "\n"
        else:
            notes = (f"{target_model}/config.json is not readable here: give model.draft_model_config a draft config "
                     f"with draft_vocab_size {size or 'the target vocabulary size'}",)  # fmt: skip
        config = {
            "model": model,
            "data": {"hidden_states_path": IN_PLACE_PREFIX + data if in_place else data,
                     **({"max_length": max_length} if max_length else {})},
            "output_dir": str(dest.resolve().parent / f"{dest.name}-draft"),
        }
        files[SPECFORGE_CONFIG] = json.dumps(config, indent=2) + "\n"
        return Launch(files, f"{launcher}specforge train -c {dest.resolve() / SPECFORGE_CONFIG}", notes)
    if trainer == "speculators":
        args = ["--verifier-name-or-path", target_model, "--data-path", data, "--on-missing", "raise"]
        args += ["--target-layer-ids", *map(str, layers)]
        if in_place:
            args += ["--hidden-states-backend", SPECULATORS_BACKEND]
        if max_length:
            args += ["--total-seq-len", str(max_length)]
        if size:
            args += ["--draft-vocab-size", str(size)]
        path = dest.resolve() / SPECULATORS_ARGS
        return Launch({SPECULATORS_ARGS: "\n".join(args) + "\n"},
                      f"{launcher}speculators train $(cat {shlex.quote(str(path))})")  # fmt: skip
    if trainer == "modelopt":
        outputs = trainer_layer_ids(layers)["modelopt"]
        overrides = [f"model.model_name_or_path={target_model}", f"data.offline_data_path={data}",
                     "training.answer_only_loss=true"]  # fmt: skip
        if outputs is not None:
            overrides.append(f"eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids=[{','.join(map(str, outputs))}]")
        if vocab is not None:
            overrides.append(f"data.draft_vocab_cache={(vocab / VOCAB_D2T_PT).resolve()}")
        if max_length:
            overrides.append(f"training.training_seq_len={max_length}")
        notes = (f"the EAGLE config's draft_vocab_size must be {size}",) if size else ()
        if in_place:
            notes += ("in place: Model-Optimizer's launcher builds OfflineSupervisedDataset over the .pt files "
                      "it lists; give it hsx_extractor.in_place.modelopt.OfflineDataset(offline_data_path, "
                      "answer_only_loss=True) instead (docs/training.md)",)  # fmt: skip
        if outputs is None:
            notes += ("capture layer 0 (the embeddings) has no layer-output id in Model-Optimizer: its "
                      "eagle_aux_hidden_state_layer_ids are left to you",)  # fmt: skip
        path = dest.resolve() / MODELOPT_OVERRIDES
        return Launch(
            {MODELOPT_OVERRIDES: "\n".join(overrides) + "\n"},
            # Run from a checkout of Model-Optimizer (its launcher imports its neighbours; it is not in the wheel).
            f"python examples/speculative_decoding/main.py --config {MODELOPT_RECIPE} $(cat {shlex.quote(str(path))})"
            + (" (with its dataset line changed to hsx's OfflineDataset: docs/training.md)" if in_place else ""),
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
