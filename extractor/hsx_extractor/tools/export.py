"""``hsx export --to specforge|speculators|modelopt OUTPUT DEST``: a committed run in a trainer's own layout.

Streams the run through :class:`OutputReader` (local or S3, every sample checksummed) and writes one
file per sample in the layout each trainer's offline loader reads (docs/training.md):

* ``specforge``: ``rows_{g}-{g+2000}/data_{index}.ckpt``, ``torch.save`` of ``input_ids`` long [L],
  ``loss_mask`` long [L], ``hidden_state`` bf16 [1, L, H], ``aux_hidden_state`` bf16 [1, L, K*H]
  (SpecForge 0.2's ``OfflineManifestReader``; the final state post-norm: SGLang's).
* ``speculators``: a ``datasets`` directory (``input_ids``, ``loss_mask``, ``seq_len``; torch format)
  and ``hidden_states/hs_{position}.safetensors`` holding ``token_ids`` int64 [T] and
  ``hidden_states`` bf16 [T, K+1, H], the last slot the final state **pre-norm** (speculators'
  ``ArrowDataset`` + ``FileTransfer``; its trainer applies the verifier's norm itself).
* ``modelopt``: ``{index}.pt``, ``torch.save`` of ``input_ids``, ``hidden_states`` [L, H] (post-norm),
  ``aux_hidden_states`` [L, K*H], ``loss_mask``, ``conversation_id`` (Model-Optimizer's
  ``OfflineSupervisedDataset``).

The final-norm convention is never guessed: the run's manifest says which state it holds
(``capture.finalState``, read through :attr:`OutputReader.capture`), or a caller states the whole capture
(``capture=Capture(...)``, refused if it contradicts the manifest). Pre-norm data for
a post-norm trainer goes through the model's own final RMSNorm when ``model_dir`` is given
(:mod:`hsx_extractor.tools.final_norm`); post-norm data for a pre-norm trainer is refused (the norm
cannot be undone). ``DEST`` must be new or empty; ``hsx-export.json`` is written last, so a
directory without it is an interrupted export.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx_extractor.config import OutputSpec, check_local_directory
from hsx_extractor.storage.manifest import FINAL_STATES, Capture, ManifestError

if TYPE_CHECKING:
    import torch

    from hsx_extractor.tools.final_norm import FinalNorm

POST_NORM, PRE_NORM = FINAL_STATES
EXPORT_RECORD = "hsx-export.json"
SPECFORGE_GROUP = 2000  # samples per rows_* folder, as SpecForge's prepare_hidden_states writes them


class ExportError(Exception):
    """The export is refused (convention, destination) or its input is unusable."""


@dataclass(frozen=True)
class Sample:
    position: int  # 0-based among the run's samples, in dataset order
    index: int  # dataset index (the sample's identity in the run)
    input_ids: torch.Tensor  # long [L]
    loss_mask: torch.Tensor  # long [L]
    aux: torch.Tensor  # bf16 [L, K*H]
    final: torch.Tensor  # bf16 [L, H], in the convention the trainer wants


def _save_torch(obj: dict[str, Any], path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a trainer listing the folder never sees half a file


def specforge_features(s: Sample) -> dict[str, torch.Tensor]:
    """A sample as SpecForge's offline feature file holds it (the keys its ``OfflineManifestReader`` loads)."""
    return {
        "input_ids": s.input_ids,
        "loss_mask": s.loss_mask,
        "hidden_state": s.final.unsqueeze(0),
        "aux_hidden_state": s.aux.unsqueeze(0),
    }


def speculators_states(s: Sample, num_aux: int, hidden_size: int) -> dict[str, torch.Tensor]:
    """A sample as speculators' hidden-states file holds it: ``token_ids`` [T] and ``hidden_states``
    [T, K+1, H], the K aux layers then the final state."""
    import torch

    seq_len = int(s.input_ids.shape[0])
    layers = s.aux.reshape(seq_len, num_aux, hidden_size)
    return {
        "token_ids": s.input_ids.contiguous(),
        "hidden_states": torch.cat([layers, s.final.unsqueeze(1)], dim=1).contiguous(),
    }


class SpecForgeWriter:
    wants = POST_NORM

    def __init__(self, dest: Path, hidden_size: int, num_aux: int):
        self.dest = dest

    def add(self, s: Sample) -> None:
        group = s.index // SPECFORGE_GROUP * SPECFORGE_GROUP
        path = self.dest / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{s.index}.ckpt"
        _save_torch(specforge_features(s), path)

    def close(self) -> dict[str, Any]:
        return {}


class ModelOptWriter:
    wants = POST_NORM

    def __init__(self, dest: Path, hidden_size: int, num_aux: int):
        self.dest = dest

    def add(self, s: Sample) -> None:
        _save_torch(
            {
                "input_ids": s.input_ids,
                "hidden_states": s.final,
                "aux_hidden_states": s.aux,
                "loss_mask": s.loss_mask,
                "conversation_id": s.index,
            },
            self.dest / f"{s.index}.pt",
        )

    def close(self) -> dict[str, Any]:
        return {}


class SpeculatorsWriter:
    """Hidden states per position (speculators' file index is the dataset row's position), rows as Arrow.

    The row table is written with pyarrow in the layout ``datasets.Dataset.save_to_disk`` writes
    (Arrow stream, ``dataset_info.json``, ``state.json`` with the torch format), so hsx needs no
    ``datasets`` package; the tests load it with the real ``datasets.load_from_disk``.
    """

    wants = PRE_NORM
    ARROW = "data-00000-of-00001.arrow"
    BATCH = 256

    def __init__(self, dest: Path, hidden_size: int, num_aux: int, states: bool = True):
        import pyarrow as pa

        self.dest, self.hidden_size, self.num_aux, self.states = dest, hidden_size, num_aux, states
        if states:  # in place: the rows only, the states stay in the run
            (dest / "hidden_states").mkdir(parents=True, exist_ok=True)
        ints = pa.list_(pa.int64())
        self.schema = pa.schema(
            [("input_ids", ints), ("loss_mask", ints), ("seq_len", pa.int64()), ("hsx_index", pa.int64())],
            metadata={"huggingface": json.dumps({"info": {"features": self.features()}})},
        )
        self.sink = pa.OSFile(str(dest / self.ARROW), "wb")
        self.writer = pa.ipc.new_stream(self.sink, self.schema)
        self.rows: dict[str, list[Any]] = {name: [] for name in self.schema.names}

    @staticmethod
    def features() -> dict[str, Any]:
        value = {"dtype": "int64", "_type": "Value"}
        ints = {"feature": value, "_type": "List"}
        return {"input_ids": ints, "loss_mask": ints, "seq_len": value, "hsx_index": value}

    def add(self, s: Sample) -> None:
        from safetensors.torch import save_file

        seq_len = int(s.input_ids.shape[0])
        if self.states:
            path = self.dest / "hidden_states" / f"hs_{s.position}.safetensors"
            tmp = path.with_name(path.name + ".tmp")
            save_file(speculators_states(s, self.num_aux, self.hidden_size), str(tmp))
            os.replace(tmp, path)
        for name, value in (
            ("input_ids", s.input_ids.tolist()),
            ("loss_mask", s.loss_mask.tolist()),
            ("seq_len", seq_len),
            ("hsx_index", s.index),
        ):
            self.rows[name].append(value)
        if len(self.rows["seq_len"]) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.rows["seq_len"]:
            self.writer.write_batch(pa.record_batch(self.rows, schema=self.schema))
            self.rows = {name: [] for name in self.schema.names}

    def close(self) -> dict[str, Any]:
        self._flush()
        self.writer.close()
        self.sink.close()
        info = {"citation": "", "description": "", "features": self.features(), "homepage": "", "license": ""}
        (self.dest / "dataset_info.json").write_text(json.dumps(info, indent=2))
        state: dict[str, Any] = {
            "_data_files": [{"filename": self.ARROW}],
            "_fingerprint": os.urandom(8).hex(),
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": "torch",
            "_output_all_columns": False,
            "_split": None,
        }
        (self.dest / "state.json").write_text(json.dumps(state, indent=2))
        states = "hidden_states/hs_{position}.safetensors" if self.states else None
        return {"hiddenStates": states, "rows": self.ARROW}


WRITERS: dict[str, Callable[[Path, int, int], Any]] = {
    "specforge": SpecForgeWriter,
    "speculators": SpeculatorsWriter,
    "modelopt": ModelOptWriter,
}
TRAINERS = tuple(WRITERS)


def _check_dest(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportError(
            f"{dest} exists and is not an empty directory (an export never mixes with other files)"
        )
    dest.mkdir(parents=True, exist_ok=True)


def plan_conversion(trainer: str, have: str, model_dir: str | None, hidden_size: int) -> FinalNorm | None:
    """The norm to apply (None: states go as stored), or ExportError when the trainer cannot get what it expects."""
    wants = WRITERS[trainer].wants  # type: ignore[attr-defined]
    if have == wants:
        return None
    if have == POST_NORM:
        raise ExportError(
            f"{trainer} expects the final state before the final norm and applies the norm itself; this run "
            "holds it after the norm, which cannot be undone: exporting it would apply the norm twice"
        )
    if model_dir is None:
        raise ExportError(
            f"{trainer} expects the final state after the final norm and this run holds it before: pass "
            "--model DIR (the target model) to apply its final RMSNorm"
        )
    from hsx_extractor.tools.final_norm import FinalNormError, load_final_norm

    try:
        return load_final_norm(model_dir, hidden_size)
    except (FinalNormError, OSError) as exc:
        raise ExportError(f"cannot apply the final norm from {model_dir}: {exc}") from exc


def check_norm_model(
    manifest: dict[str, Any] | None, plan: dict[str, Any] | None, model_dir: str, any_model: bool
) -> str:
    """``"same norm"`` or ``"same model"`` when ``model_dir``'s final norm is the one of the model the run
    was captured with (the manifest's ``run.finalNormDigest``; for a run without it, the model
    fingerprint of its manifest or plan); otherwise ExportError, or with ``any_model`` a note of it."""
    from hsx_extractor.model import final_norm_digest, model_fingerprint

    run = (manifest or {}).get("run") or {}
    recorded_norm = run.get("finalNormDigest")
    recorded_model = run.get("modelFingerprint") or ((plan or {}).get("identity") or {}).get("model")
    mine: object
    if recorded_norm:
        mine, what = final_norm_digest(model_dir), "final norm weight"
        recorded, same = recorded_norm, "same norm"
    elif recorded_model:
        mine, what = model_fingerprint(model_dir), "config.json and weight index"
        recorded, same = recorded_model, "same model"
    elif any_model:
        return "unchecked: the run records neither its final norm nor its model (--any-model)"
    else:
        raise ExportError(
            f"the run records neither its final norm nor its model, so nothing shows that {model_dir}'s norm "
            "belongs to these states; pass --any-model to apply it anyway"
        )
    if mine == recorded:
        return same
    if any_model:
        return f"different {what} (--any-model)"
    raise ExportError(
        f"--model {model_dir} is not the model this run was captured with: its {what} differ (run {recorded}, "
        f"{model_dir} {mine}). Another model's norm (a base model's for its instruct variant) gives wrong states "
        "without any error; pass --any-model only if you know the norms are the same"
    )


class TrainerView:
    """A committed run's samples as ``trainer`` reads them: every sample checksummed, the final state in
    the trainer's convention (:func:`plan_conversion`; a norm only from the run's own model,
    :func:`check_norm_model`). What ``hsx export`` writes and what the in-place loaders
    (:mod:`hsx_extractor.in_place`) hand the trainer are both this view's samples. Picklable (DataLoader
    workers), and in a worker the states decode into shared memory (:class:`HiddenStatesDataset`)."""

    def __init__(
        self,
        uri: str,
        trainer: str,
        *,
        model_dir: str | None = None,
        any_model: bool = False,
        capture: Capture | None = None,
        output: OutputSpec | None = None,
        verify_checksums: bool = True,
    ):
        from hsx_extractor.reader import HiddenStatesDataset  # torch: not for `hsx --help`
        from hsx_extractor.storage.shard_format import AUX, FINAL

        if trainer not in WRITERS:
            raise ExportError(f"unknown trainer {trainer!r}: one of {TRAINERS}")
        self.trainer = trainer
        try:
            self.data = HiddenStatesDataset(uri, output, verify_checksums, capture=capture)
            self.source_state = self.data.reader.capture.final_state
        except ManifestError as exc:
            raise ExportError(str(exc)) from None
        if len(self.data) == 0:
            raise ExportError(f"{uri} holds no samples")
        # The widths from the first shard's checked header: no sample is read to learn them.
        shard, _, within = self.data.reader.locate(0)
        first = self.data.reader.header(shard).samples[within]
        self.hidden_size = int(first.tensor(FINAL).shape[-1])
        aux_width = int(first.tensor(AUX).shape[-1])
        if aux_width % self.hidden_size:
            raise ExportError(f"aux width {aux_width} is not a multiple of the hidden size {self.hidden_size}")
        self.num_aux = aux_width // self.hidden_size
        self.norm = plan_conversion(trainer, self.source_state, model_dir, self.hidden_size)
        self.model_check = None
        if self.norm is not None and model_dir is not None:
            from hsx_extractor.run.plan import PLAN_NAME

            reader = self.data.reader
            self.model_check = check_norm_model(reader.manifest, reader.named_json(PLAN_NAME), model_dir, any_model)

    @property
    def reader(self) -> Any:
        return self.data.reader

    def __len__(self) -> int:
        return len(self.data)

    def sample(self, position: int) -> Sample:
        t = self.data[position]
        final = t["hidden_state"].squeeze(0)
        return Sample(
            position,
            self.data.dataset_index(position),
            t["input_ids"],
            t["loss_mask"],
            t["aux_hidden_state"].squeeze(0),
            self.norm(final) if self.norm is not None else final,
        )


def export(
    uri: str,
    trainer: str,
    dest: str | Path,
    *,
    model_dir: str | None = None,
    any_model: bool = False,
    target_model: str | None = None,
    vocab: str | None = None,
    in_place: bool = False,
    capture: Capture | None = None,
    output: OutputSpec | None = None,
    verify_checksums: bool = True,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Export the committed run at ``uri`` for ``trainer`` into ``dest``; returns the export record.

    ``in_place``: no hidden state is copied. ``dest`` gets the launch files and the record the in-place
    loaders open (:mod:`hsx_extractor.in_place`), and for speculators its row table (token ids and loss
    masks: the ``datasets`` folder its trainer indexes)."""
    root = check_local_directory(str(dest), "export destination")
    view = TrainerView(uri, trainer, model_dir=model_dir, any_model=any_model, capture=capture, output=output,
                       verify_checksums=verify_checksums)  # fmt: skip
    from hsx_extractor.tools import trainer_launch

    vocab_dir = Path(vocab) if vocab else None
    if vocab_dir is not None:
        trainer_launch.draft_vocab_size(vocab_dir)  # refused before any data is written
    _check_dest(root)
    reader = view.reader
    if not in_place:
        writer = WRITERS[trainer](root, view.hidden_size, view.num_aux)
    elif trainer == "speculators":
        writer = SpeculatorsWriter(root, view.hidden_size, view.num_aux, states=False)
    else:
        writer = None  # the trainer lists samples through the in-place loader: nothing per sample
    extra: dict[str, Any] = {}
    if writer is not None:
        for position in range(len(view)):
            writer.add(view.sample(position))
            if (position + 1) % 1000 == 0:
                log(f"hsx export: {position + 1}/{len(view)} samples")
        extra = writer.close()
    record = {
        "format": "hsx-export/1",
        "trainer": trainer,
        "source": uri if uri.startswith("s3://") else str(Path(uri.removeprefix("file://")).resolve()),
        "inPlace": in_place,
        "runId": reader.run_id,
        "samples": len(view),
        "hiddenSize": view.hidden_size,
        "auxLayers": view.num_aux,
        "layerIds": list(reader.capture.layer_ids),
        "trainerLayerIds": trainer_launch.trainer_layer_ids(list(reader.capture.layer_ids)),
        "layerConvention": reader.capture.layer_convention,
        "sourceFinalState": view.source_state,
        "finalState": WRITERS[trainer].wants,  # type: ignore[attr-defined]
        "finalNormApplied": view.norm.source if view.norm is not None else None,
        "finalNormModel": view.model_check,
        # Where an in-place loader takes the norm from (it applies it as each sample is read).
        "finalNormModelDir": str(Path(model_dir).resolve()) if in_place and view.norm is not None and model_dir else None,
        "anyModel": any_model,
        **extra,
    }
    run = (reader.manifest or {}).get("run") or {}
    target = target_model or model_dir or run.get("model")
    placed = trainer_launch.place_vocab(trainer, vocab_dir, root) if vocab_dir is not None else []
    if target:
        how = trainer_launch.launch(trainer, record, root, str(target), run.get("maxLength"), vocab_dir)
        for name, text in how.files.items():
            (root / name).write_text(text)
        record["launch"] = {"files": sorted(how.files), "command": how.command, "notes": list(how.notes), "vocab": placed}
    (root / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def open_in_place(dest: str | Path, trainer: str) -> TrainerView:
    """The run an in-place export folder points at, as ``trainer`` reads it (S3 settings from the AWS
    chain: ``AWS_ENDPOINT_URL_S3`` and the credentials of the trainer's environment)."""
    path = Path(dest) / EXPORT_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: not an hsx export record ({exc}); make one with `hsx export --in-place`") from None
    if not record.get("inPlace"):
        raise ExportError(f"{dest} is a copied export, not an in-place one: read its files with {record.get('trainer')}")
    if record.get("trainer") != trainer:
        raise ExportError(f"{dest} was made for {record.get('trainer')}, not {trainer}: export again with --to {trainer}")
    view = TrainerView(record["source"], trainer, model_dir=record.get("finalNormModelDir"),
                       any_model=bool(record.get("anyModel")))  # fmt: skip
    if view.reader.run_id != record["runId"] or len(view) != record["samples"]:
        raise ExportError(f"{record['source']} is not the run {dest} was made from (run {record['runId']}, "
                          f"{record['samples']} samples; now {view.reader.run_id}, {len(view)})")  # fmt: skip
    return view
