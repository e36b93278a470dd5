"""Runs in the trainers venv: load an export with the trainer's OWN data code, write what it got (hsx itself
only in the ``-in-place`` modes, where the trainer's loader reads the run through hsx_extractor.in_place).

``python trainer_side.py specforge|speculators|modelopt[-in-place] EXPORT_DIR OUT.safetensors [MAX_LEN]``
``python trainer_side.py specforge-step|speculators-step EXPORT_DIR OUT.safetensors MAX_LEN MODEL_DIR`` (a training step)

Each mode goes through the trainer's offline loading path as its training entry point wires it
(SpecForge 0.2: reader -> feature store -> EAGLE-3 normalizer -> collator; speculators 0.9:
``ArrowDataset`` + ``CollateFn`` + ``shift_batch``; Model-Optimizer 0.47: ``OfflineSupervisedDataset``
+ ``EagleOfflineDataCollator``) and saves, per sample, the tensors the trainer would train on, keyed
``{n}.{name}`` with ``{n}.key`` naming the file it came from, for the test to compare with hsx's output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def dataset_index(view: Any, position: int) -> torch.Tensor:
    return torch.tensor([view.data.dataset_index(position)])


def specforge(export: Path, max_len: int, in_place: bool = False) -> dict[str, torch.Tensor]:
    from specforge.algorithms.eagle3.data import (
        build_offline_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    path = str(export)
    if in_place:  # the seam python -m hsx_extractor.in_place specforge installs, and the path hsx export writes
        from hsx_extractor.in_place import specforge as hsx_specforge

        hsx_specforge.install()
        path = json.loads((export / "specforge.json").read_text())["data"]["hidden_states_path"]
    refs = build_offline_reader(path, run_id="hsx", ttt_length=7, max_len=max_len).read()
    store = LocalFeatureStore()
    normalize = build_offline_normalizer(max_len)
    out: dict[str, torch.Tensor] = {}
    items = []
    for n, ref in enumerate(refs):
        raw, handle = store.get(ref)
        item = normalize(raw)
        store.release(handle)
        items.append(item)
        if in_place:  # hsx:DEST#position
            out[f"{n}.index"] = dataset_index(hsx_specforge._view(str(export)), int(ref.feature_store_uri.split("#")[1]))
        else:
            name = Path(ref.feature_store_uri).name  # data_{index}.ckpt
            out[f"{n}.index"] = torch.tensor([int(name.split("_")[1].split(".")[0])])
        for key in ("input_ids", "loss_mask", "hidden_state", "target"):
            out[f"{n}.{key}"] = item[key].contiguous()
    batch = build_offline_collator()(items[:2])  # SpecForge's own padding collator
    out["batch.input_ids"] = batch["input_ids"].contiguous()
    out["batch.loss_mask"] = batch["loss_mask"].contiguous()
    return out


def speculators(export: Path, max_len: int, in_place: bool = False) -> dict[str, torch.Tensor]:
    from hs_connectors import HiddenStatesBackend
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    transfer = None
    if in_place:  # as speculators' train CLI builds it: the backend named by --hidden-states-backend
        from hsx_extractor.in_place.speculators import register

        register()
        transfer = HiddenStatesBackend.registry["hsx"].from_train_args(None, str(export))
    ds = ArrowDataset(max_len=max_len, datapath=str(export), on_missing="raise", transfer=transfer)
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


def specforge_step(export: Path, max_len: int, target: str) -> dict[str, torch.Tensor]:
    """One CPU training step of a 1-layer EAGLE-3 draft through SpecForge's own offline strategy.

    Data as SpecForge's offline path delivers it (reader, feature store, normaliser, collator); the
    frozen ``TargetHead`` (the target's lm_head, no norm: SpecForge expects post-norm states) turns the
    stored final state into the teacher; ``Eagle3TrainStrategy.forward_loss`` over
    ``OnlineEagle3Model`` computes the loss, with a full-vocabulary mapping. The one substitution: the
    loss kernel (Triton, GPU only) by SpecForge's torch reference of it."""
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.algorithms.eagle3.data import (
        build_offline_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.core.loss import _compute_loss
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import AutoConfig

    # SpecForge's KL loss is a Triton kernel (GPU only); on CPU use SpecForge's own torch reference of
    # the same loss (specforge/core/loss.py), uncompiled. Everything else is SpecForge's code as is.
    reference = getattr(_compute_loss, "_torchdynamo_orig_callable", _compute_loss)

    class ReferenceLoss:
        apply = staticmethod(reference)

    eagle3_model.LogSoftmaxLoss = ReferenceLoss  # type: ignore[misc,assignment]
    torch.manual_seed(0)
    refs = build_offline_reader(str(export), run_id="hsx", ttt_length=2, max_len=max_len).read()
    store = LocalFeatureStore()
    normalize = build_offline_normalizer(max_len)
    items = []
    for ref in refs[:2]:
        raw, handle = store.get(ref)
        items.append(normalize(raw))
        store.release(handle)
    batch = build_offline_collator()(items)
    config = AutoConfig.from_pretrained(target)
    config.num_hidden_layers = 1
    config.draft_vocab_size = config.vocab_size
    draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa").to(torch.bfloat16)  # as SpecForge trains
    draft.t2d.fill_(True)
    draft.d2t.zero_()
    head = TargetHead.from_pretrained(target)
    strategy = Eagle3TrainStrategy(
        OnlineEagle3Model(draft, length=2, attention_backend="sdpa"), target_head=head
    )
    tensors = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "hidden_state", "target")}
    train = TrainBatch(sample_ids=[r.sample_id for r in refs[:2]], strategy="eagle3", tensors=tensors,
                       metadata={"target_repr": "hidden_state"})  # fmt: skip
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = strategy.forward_loss(train).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": torch.tensor(losses), "head": head.fc.weight.detach().contiguous()}


def speculators_step(export: Path, max_len: int, verifier: str) -> dict[str, torch.Tensor]:
    """One CPU training step of a 1-layer EAGLE-3 draft with speculators' own model, loss and data path.

    The draft is built as speculators' trainer builds it (``Eagle3DraftModel.from_training_args``,
    verifier weights -- embeddings, lm_head and the final norm it applies to the pre-norm states --
    loaded from ``verifier``), over a full-vocabulary mapping."""
    import copy

    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from transformers import AutoConfig

    torch.manual_seed(0)
    verifier_config = AutoConfig.from_pretrained(verifier)
    draft_config = copy.deepcopy(verifier_config)
    draft_config.num_hidden_layers = 1
    vocab = verifier_config.vocab_size
    ds = ArrowDataset(max_len=max_len, datapath=str(export), on_missing="raise")
    hidden = verifier_config.hidden_size
    batch = CollateFn(max_len, hidden, preprocess=shift_batch)([ds[n] for n in range(len(ds))])
    record = json.loads((export / "hsx-export.json").read_text())
    model = Eagle3DraftModel.from_training_args(
        draft_config,
        t2d=torch.ones(vocab, dtype=torch.bool),
        d2t=torch.zeros(vocab, dtype=torch.long),
        verifier_name_or_path=verifier,
        draft_vocab_size=vocab,
        norm_before_residual=True,
        ttt_steps=2,
        target_layer_ids=record["layerIds"],  # the layers hsx captured, as its manifest says
        draft_attn_impl="sdpa",
    )
    model.float()
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=2, ttt_step_loss_decay=1.0
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inputs = {
        k: batch[k] for k in ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids")
    }
    inputs["hidden_states"] = inputs["hidden_states"].float()
    inputs["verifier_last_hidden_states"] = batch["verifier_last_hidden_states"].float()
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        _, loss, _ = model(**inputs, **train_kwargs)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {
        "losses": torch.tensor(losses),
        "verifier_norm": model.verifier_norm.weight.detach().float().contiguous(),
        "fc_grad": model.fc.weight.grad.detach().abs().sum().reshape(1),
        "target_layer_ids": torch.tensor(model.target_layer_ids),
    }


def modelopt(export: Path, max_len: int, in_place: bool = False) -> dict[str, torch.Tensor]:
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    if in_place:  # the one line of Model-Optimizer's launcher that docs/training.md changes
        from hsx_extractor.in_place.modelopt import OfflineDataset

        ds = OfflineDataset(export, answer_only_loss=True)
    else:
        files = sorted(str(p) for p in export.rglob("*.pt"))  # as Model-Optimizer's example lists them
        ds = OfflineSupervisedDataset(files, answer_only_loss=True)
    out: dict[str, torch.Tensor] = {}
    items = []
    for n in range(len(ds)):
        item = ds[n]
        items.append(item)
        out[f"{n}.index"] = dataset_index(ds.view, n) if in_place else torch.tensor([int(Path(files[n]).stem)])
        out[f"{n}.prenorm"] = torch.tensor([int(item["base_hidden_prenorm"])])
        for key in ("input_ids", "loss_mask", "labels", "base_model_hidden_states", "aux_hidden_states"):
            out[f"{n}.{key}"] = item[key].contiguous()
    batch = EagleOfflineDataCollator(max_len)(items[:2])
    out["batch.input_ids"] = batch["input_ids"].contiguous()
    out["batch.aux_hidden_states"] = batch["base_model_outputs"]["aux_hidden_states"].contiguous()
    return out


def modelopt_train(export: Path, max_len: int, in_place: bool) -> dict[str, torch.Tensor]:
    """Model-Optimizer's EAGLE-3 offline training as its examples/speculative_decoding/main.py wires it (that
    launcher is not in the wheel): its ``eagle3`` recipe with the export's ``modelopt.overrides``, its model
    loader and ``mtsp.convert``, its offline dataset and collator, its training arguments in a Hugging Face
    ``Trainer``; then ``save_model``. In place, the dataset is hsx's ``OfflineDataset`` (docs/training.md's
    one-line change). CPU switches: no torch.compile, no TF32, ``use_cpu``; bf16 stays (autocast on CPU)."""
    import dataclasses

    import modelopt.torch.opt as mto
    import modelopt.torch.speculative as mtsp
    import transformers
    from modelopt.recipe import load_recipe
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.hf_training_args import TrainingArguments as SpecTrainingArgs
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    mto.enable_huggingface_checkpointing()
    out_dir = export.parent / f"{export.name}-drafter"
    overrides = [line for line in (export / "modelopt.overrides").read_text().splitlines() if line]
    overrides += ["eagle.eagle_use_torch_compile=false", "training.tf32=false", f"training.output_dir={out_dir}",
                  "training.warmup_steps=0", "training.logging_steps=1", "training.num_train_epochs=3",
                  f"training.training_seq_len={max_len}", "training.learning_rate=1e-3"]  # fmt: skip
    recipe = load_recipe("general/speculative_decoding/eagle3", overrides=overrides)
    fields = [(n, f.annotation, dataclasses.field(default=f.default)) for n, f in SpecTrainingArgs.model_fields.items()]
    hf_args = dataclasses.make_dataclass("HfTrainingArguments", fields, bases=(transformers.TrainingArguments,))
    hf_args.__module__ = __name__  # the Trainer pickles its arguments with the checkpoint: findable by name
    globals()["HfTrainingArguments"] = hf_args
    args = hf_args(**recipe.training.model_dump(), use_cpu=True, report_to=[])
    model = load_vlm_or_llm(recipe.model.model_name_or_path, use_fake_base=recipe.model.use_fake_base_for_offline,
                            use_offline_training=True, dtype="auto", device_map="cpu")  # fmt: skip
    mtsp.convert(model, [("eagle", recipe.eagle.model_dump())])
    if in_place:
        from hsx_extractor.in_place.modelopt import OfflineDataset

        dataset: Any = OfflineDataset(recipe.data.offline_data_path, answer_only_loss=args.answer_only_loss)
    else:
        files = sorted(str(p) for p in Path(recipe.data.offline_data_path).rglob("*.pt"))
        dataset = OfflineSupervisedDataset(files, answer_only_loss=args.answer_only_loss)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                   data_collator=EagleOfflineDataCollator(args.training_seq_len))  # fmt: skip
    trainer.train()
    trainer.save_model(str(out_dir))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    saved = sorted(p.name for p in out_dir.iterdir())
    print(f"modelopt-train: losses {losses}; saved {saved}", flush=True)
    return {"losses": torch.tensor(losses), "saved_bytes": torch.tensor([sum(p.stat().st_size for p in out_dir.rglob("*"))])}


def main(argv: list[str]) -> int:
    mode, export, dest = argv[0], Path(argv[1]), argv[2]
    max_len = int(argv[3]) if len(argv) > 3 else 2048
    if mode.startswith("modelopt-train"):
        loaded = modelopt_train(export, max_len, mode.endswith("-in-place"))
    elif mode.endswith("-step"):
        loaded = {"specforge-step": specforge_step, "speculators-step": speculators_step}[mode](
            export, max_len, argv[4]
        )
    else:
        in_place = mode.endswith("-in-place")
        loaded = {"specforge": specforge, "speculators": speculators, "modelopt": modelopt}[mode.removesuffix("-in-place")](
            export, max_len, in_place
        )
    save_file(loaded, dest)
    print(f"{mode}: {sorted(loaded)[:6]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
