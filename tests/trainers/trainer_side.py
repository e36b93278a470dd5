"""Runs in the trainers venv (no hsx there): load an export with the trainer's OWN data code, write what it got.

``python trainer_side.py specforge|speculators|modelopt EXPORT_DIR OUT.safetensors [MAX_LEN]``

Each mode goes through the trainer's offline loading path as its training entry point wires it
(SpecForge 0.2: reader -> feature store -> EAGLE-3 normalizer -> collator; speculators 0.9:
``ArrowDataset`` + ``CollateFn`` + ``shift_batch``; Model-Optimizer 0.47: ``OfflineSupervisedDataset``
+ ``EagleOfflineDataCollator``) and saves, per sample, the tensors the trainer would train on, keyed
``{n}.{name}`` with ``{n}.key`` naming the file it came from, for the test to compare with hsx's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def specforge(export: Path, max_len: int) -> dict[str, torch.Tensor]:
    from specforge.algorithms.eagle3.data import (
        build_offline_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    refs = build_offline_reader(str(export), run_id="hsx", ttt_length=7, max_len=max_len).read()
    store = LocalFeatureStore()
    normalize = build_offline_normalizer(max_len)
    out: dict[str, torch.Tensor] = {}
    items = []
    for n, ref in enumerate(refs):
        raw, handle = store.get(ref)
        item = normalize(raw)
        store.release(handle)
        items.append(item)
        name = Path(ref.feature_store_uri).name  # data_{index}.ckpt
        out[f"{n}.index"] = torch.tensor([int(name.split("_")[1].split(".")[0])])
        for key in ("input_ids", "loss_mask", "hidden_state", "target"):
            out[f"{n}.{key}"] = item[key].contiguous()
    batch = build_offline_collator()(items[:2])  # SpecForge's own padding collator
    out["batch.input_ids"] = batch["input_ids"].contiguous()
    out["batch.loss_mask"] = batch["loss_mask"].contiguous()
    return out


def speculators(export: Path, max_len: int) -> dict[str, torch.Tensor]:
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    ds = ArrowDataset(max_len=max_len, datapath=str(export), on_missing="raise")
    out: dict[str, torch.Tensor] = {}
    items = []
    for n in range(len(ds)):
        item = ds[n]
        items.append(item)
        out[f"{n}.index"] = torch.tensor([int(ds.data[n]["hsx_index"])])
        for key in ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states"):
            out[f"{n}.{key}"] = item[key].contiguous()
    hidden = items[0]["verifier_last_hidden_states"].shape[-1]
    batch = CollateFn(max_len, hidden, preprocess=shift_batch)(items)
    for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "document_ids"):
        out[f"batch.{key}"] = batch[key].contiguous()
    return out


def modelopt(export: Path, max_len: int) -> dict[str, torch.Tensor]:
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    files = sorted(str(p) for p in export.rglob("*.pt"))  # as Model-Optimizer's example lists them
    ds = OfflineSupervisedDataset(files, answer_only_loss=True)
    out: dict[str, torch.Tensor] = {}
    items = []
    for n in range(len(ds)):
        item = ds[n]
        items.append(item)
        out[f"{n}.index"] = torch.tensor([int(Path(files[n]).stem)])
        out[f"{n}.prenorm"] = torch.tensor([int(item["base_hidden_prenorm"])])
        for key in ("input_ids", "loss_mask", "labels", "base_model_hidden_states", "aux_hidden_states"):
            out[f"{n}.{key}"] = item[key].contiguous()
    batch = EagleOfflineDataCollator(max_len)(items[:2])
    out["batch.input_ids"] = batch["input_ids"].contiguous()
    out["batch.aux_hidden_states"] = batch["base_model_outputs"]["aux_hidden_states"].contiguous()
    return out


def main(argv: list[str]) -> int:
    mode, export, dest = argv[0], Path(argv[1]), argv[2]
    max_len = int(argv[3]) if len(argv) > 3 else 2048
    loaded = {"specforge": specforge, "speculators": speculators, "modelopt": modelopt}[mode](export, max_len)
    save_file(loaded, dest)
    print(f"{mode}: {sum(1 for k in loaded if k.endswith('.index'))} samples loaded", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
