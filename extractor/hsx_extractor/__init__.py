"""hsx extractor: dataset -> exact tokens -> server dumps -> validated shards in object storage.

The public face, for trainers and scripts::

    from hsx_extractor import Capture, HiddenStatesDataset, OutputReader, ExtractConfig, FollowedRun

Everything else is imported from the module that owns it (docs/architecture.md). The names
below load on first use, so importing one small module (the operator imports ``config`` and
``contract``) never pulls in numpy or torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "HiddenStatesDataset": "hsx_extractor.reader",
    "FollowedRun": "hsx_extractor.reader",
    "RunStalled": "hsx_extractor.reader",
    "OutputReader": "hsx_extractor.reader",
    "ExtractConfig": "hsx_extractor.config",
    "Capture": "hsx_extractor.storage.manifest",
}
__all__ = [
    "Capture",
    "ExtractConfig",
    "FollowedRun",
    "HiddenStatesDataset",
    "OutputReader",
    "RunStalled",
    "__version__",
]

if TYPE_CHECKING:
    from hsx_extractor.config import ExtractConfig
    from hsx_extractor.reader import FollowedRun, HiddenStatesDataset, OutputReader, RunStalled
    from hsx_extractor.storage.manifest import Capture


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hsx_extractor' has no attribute {name!r}")
