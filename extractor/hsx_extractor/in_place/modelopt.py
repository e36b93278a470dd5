"""Model-Optimizer 0.47 reading a run in place: :class:`OfflineDataset`, the items of its
``OfflineSupervisedDataset`` (``modelopt.torch.speculative.eagle.utils``) from the run.

Its EAGLE-3 launcher (examples/speculative_decoding, not in its wheel) builds ``OfflineSupervisedDataset``
over the ``.pt`` files it lists under ``data.offline_data_path``; the one line to change gives it
``OfflineDataset(offline_data_path, answer_only_loss=...)`` instead, with ``offline_data_path`` an
in-place export folder. Items have the same keys, dtypes and values (tests/trainers compare them with
``OfflineSupervisedDataset`` over a copied export, and through ``EagleOfflineDataCollator``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hsx_extractor.tools.export import open_in_place

try:
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover - no torch, no trainer
    _Base = object  # type: ignore[assignment,misc]


class OfflineDataset(_Base):  # type: ignore[misc,valid-type]
    def __init__(self, dest: str | Path, answer_only_loss: bool = False):
        super().__init__()
        self.view = open_in_place(dest, "modelopt")
        self.answer_only_loss = answer_only_loss

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch
        from modelopt.torch.speculative.eagle.utils import IGNORE_TOKEN_ID

        s = self.view.sample(i)
        ids = s.input_ids
        labels = torch.full_like(ids, IGNORE_TOKEN_ID)
        labels[:-1] = ids[1:]  # each position's label is the next token; the last has none
        return {
            "input_ids": ids,
            "base_model_hidden_states": s.final,
            "aux_hidden_states": s.aux,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": s.loss_mask.to(ids.dtype) if self.answer_only_loss else torch.ones_like(ids),
            "labels": labels,
            "base_hidden_prenorm": False,  # the view hands Model-Optimizer post-norm states
        }
