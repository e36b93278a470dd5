"""speculators 0.9 reading a run in place: the ``hsx`` hidden-states backend (``--hidden-states-backend hsx``).

speculators' trainer takes its rows (token ids, loss masks, lengths) from the ``datasets`` folder at
``--data-path`` and each sample's hidden states from a ``HiddenStatesTransfer`` that its backend registry
builds (``hs_connectors``; the ``file`` backend reads ``hidden_states/hs_{i}.safetensors``). An in-place
export folder holds the rows; :class:`RunTransfer` reads sample ``i``'s states from the run. The backend
must be registered before speculators' config module is imported (it collects every backend's flags
then): :func:`register`, which ``python -m hsx_extractor.in_place speculators`` calls first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hsx_extractor.tools.export import TrainerView, open_in_place, speculators_states
from hsx_extractor.tools.trainer_launch import SPECULATORS_BACKEND


def _transfer_base() -> type:
    from hs_connectors import HiddenStatesTransfer

    return HiddenStatesTransfer


def make_transfer(dest: str | Path) -> Any:
    """A ``HiddenStatesTransfer`` over the run the in-place export at ``dest`` points at."""

    class RunTransfer(_transfer_base()):  # type: ignore[misc]
        def __init__(self, dest: Path):
            self.dest = dest
            self.view: TrainerView | None = None

        def setup(self) -> None:
            self._open()

        def _open(self) -> TrainerView:
            if self.view is None:
                self.view = open_in_place(self.dest, "speculators")
            return self.view

        def get_cached(self, file_idx: int) -> dict[str, Any] | None:
            view = self._open()
            return speculators_states(view.sample(file_idx), view.num_aux, view.hidden_size)

        def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, Any] | None:
            return None  # every sample is in the run; hsx never asks a server from the trainer

        def __reduce__(self) -> tuple[Any, ...]:  # spawned DataLoader workers open the run themselves
            return (make_transfer, (self.dest,))

    return RunTransfer(Path(dest))


def register() -> None:
    """Register the ``hsx`` backend in speculators' registry (idempotent)."""
    from hs_connectors import HiddenStatesBackend

    if SPECULATORS_BACKEND in HiddenStatesBackend.registry:
        return

    @HiddenStatesBackend.register(SPECULATORS_BACKEND)
    class RunBackend(HiddenStatesBackend):
        @staticmethod
        def add_train_args(parser: Any) -> None:
            """No flags: ``--data-path`` is the in-place export folder, whose record names the run."""

        @staticmethod
        def add_launch_args(parser: Any) -> None:
            """No flags: hsx captures with an ExtractionJob, not through vLLM's connector."""

        @staticmethod
        def from_train_args(args: Any, data_path: str) -> Any:
            return make_transfer(data_path)

        @staticmethod
        def build_kv_transfer_config(args: Any) -> dict[str, Any]:
            raise ValueError("the hsx backend reads an hsx run; capture with an ExtractionJob, not vLLM's connector")
