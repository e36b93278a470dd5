"""How a run ends badly: one exception type with its exit code, and the mapping of every other
error that can end a run to a message and an exit code (config.EXIT_*)."""

from __future__ import annotations

from .client import ServerUnavailable
from .config import EXIT_PERMANENT, EXIT_TRANSIENT
from .dataset import DatasetError
from .store import PermanentStoreError, StoreError


class RunFailed(Exception):
    """The run stops; ``exit_code`` is what ``hsx extract`` exits with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def permanent(message: str) -> RunFailed:
    return RunFailed(message, EXIT_PERMANENT)


def describe_failure(exc: BaseException) -> tuple[str, int]:
    """Message and exit code for any error that ends a run."""
    if isinstance(exc, RunFailed):
        return str(exc), exc.exit_code
    if isinstance(exc, PermanentStoreError | DatasetError):
        return str(exc), EXIT_PERMANENT
    if isinstance(exc, StoreError):
        return str(exc), exc.exit_code
    if isinstance(exc, ServerUnavailable):
        return str(exc), EXIT_TRANSIENT
    return f"{type(exc).__name__}: {exc}", EXIT_TRANSIENT
