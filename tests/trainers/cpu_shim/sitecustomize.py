"""The smallest shim that lets the trainers' own CLIs train on CPU (docs/training.md says why each part is needed).

Put this folder on PYTHONPATH of `specforge train` / `speculators train`: Python imports ``sitecustomize`` at
start in every process, and the finder below patches two trainer modules right after they are imported:

* SpecForge 0.2 (``specforge.algorithms.eagle3.model``): its KL loss is a Triton kernel (GPU only); use
  SpecForge's own torch reference of the same loss (``specforge.core.loss._compute_loss``), uncompiled.
* speculators 0.9 (``speculators.train.trainer``): a single-process run moves the model to device index 0
  (CUDA) and its step timer synchronizes an accelerator; use the CPU and leave the timer off.

Everything else (config, data loading, model, optimizer, checkpoints) is the trainers' code as is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def _specforge_reference_loss(module: ModuleType) -> None:
    from specforge.core.loss import _compute_loss

    reference = getattr(_compute_loss, "_torchdynamo_orig_callable", _compute_loss)

    class ReferenceLoss:
        apply = staticmethod(reference)

    module.LogSoftmaxLoss = ReferenceLoss  # type: ignore[attr-defined]


def _speculators_on_cpu(module: ModuleType) -> None:
    module.get_local_rank = lambda: "cpu"  # type: ignore[attr-defined]
    trainer_init = module.Trainer.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        trainer_init(self, *args, **kwargs)
        self.device_type = "cpu"  # autocast's device

    module.Trainer.__init__ = __init__
    timer_reset = module._StepTimer.reset
    module._StepTimer.reset = lambda self, enabled: timer_reset(self, False)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "specforge.algorithms.eagle3.model": _specforge_reference_loss,
    "speculators.train.trainer": _speculators_on_cpu,
}


class _PatchAfterLoad(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterLoad(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _Finder())
