"""Train from the run where it lies: no second copy of the hidden states (docs/training.md, "In place").

``hsx export --in-place --to X RUN DEST`` writes into ``DEST`` the launch files and the export record
(for speculators also its row table: token ids and loss masks); every hidden state stays in ``RUN``.
Each trainer then reads ``RUN`` through its own data code with hsx behind the one seam it has:

* SpecForge 0.2 (:mod:`.specforge`): its offline reader lists feature files and its feature store loads
  them; ``data.hidden_states_path: hsx:DEST`` makes both go to the run.
* speculators 0.9 (:mod:`.speculators`): a hidden-states backend, its plugin interface
  (``--hidden-states-backend hsx``).
* Model-Optimizer 0.47 (:mod:`.modelopt`): a Dataset giving what its ``OfflineSupervisedDataset`` gives,
  for the one line of its launcher that builds that dataset.

``python -m hsx_extractor.in_place specforge|speculators ARGS`` installs the seam and runs the trainer's own
command line with ``ARGS``. Samples come from :class:`hsx_extractor.tools.export.TrainerView`: checksummed,
the final state in the trainer's convention, as ``hsx export`` would have written them.
"""

from hsx_extractor.tools.export import ExportError, TrainerView, open_in_place

__all__ = ["ExportError", "TrainerView", "open_in_place"]
