"""How a run ends badly: one exception type with its exit code, and the only mapping of every other
error that can end a run to a message and an exit code (contract.EXIT_*)."""

from __future__ import annotations

from hsx_extractor.contract import EXIT_PERMANENT, EXIT_TRANSIENT
from hsx_extractor.model import ModelConfigError
from hsx_extractor.protocol import DumpDirError
from hsx_extractor.run.consistency import CaptureInconsistent
from hsx_extractor.run.server_client import ServerUnavailable
from hsx_extractor.run.sources import DatasetError
from hsx_extractor.run.tokens import TokenizerError
from hsx_extractor.run.validate import DatasetRejected, DumpShapeError
from hsx_extractor.storage.backends import StoreError


class RunFailed(Exception):
    """The run stops; ``exit_code`` is what ``hsx extract`` exits with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def permanent(message: str) -> RunFailed:
    return RunFailed(message, EXIT_PERMANENT)


# Errors that retrying cannot fix: the data, the configuration or the model is wrong.
# A dump whose shape contradicts the model's (DumpShapeError) means the server runs another model
# or other capture layers than the extractor was told: every later sample would fail the same way.
# A TokenizerError can surface at the first row that needs it (format: auto, no chat template).
# A DumpDirError means the pod's containers cannot share the dump directory (their users).
# CaptureInconsistent: the server captures states its own predictions disagree with; a retry
# captures the same way.
# DatasetRejected: most rows fail the dataset checks; the same dataset and settings fail the same way.
_PERMANENT = (
    DatasetError, ModelConfigError, DumpShapeError, TokenizerError, DumpDirError, CaptureInconsistent, DatasetRejected
)


def describe_failure(exc: BaseException) -> tuple[str, int]:
    """Message and exit code for any error that ends a run."""
    if isinstance(exc, RunFailed):
        return str(exc), exc.exit_code
    if isinstance(exc, _PERMANENT):
        return str(exc), EXIT_PERMANENT
    if isinstance(exc, StoreError):
        return str(exc), exc.exit_code
    if isinstance(exc, ServerUnavailable):
        return str(exc), EXIT_TRANSIENT
    return f"{type(exc).__name__}: {exc}", EXIT_TRANSIENT


def failure_reason(exc: BaseException) -> str | None:
    """The name a failure has of its own (the operator's status reason), when it has one."""
    return getattr(exc, "failure_reason", None)
