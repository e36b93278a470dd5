"""failures.describe_failure is the one map from an error that ends a run to its exit code."""

from __future__ import annotations

import pytest

from hsx_extractor.contract import EXIT_PERMANENT, EXIT_TRANSIENT
from hsx_extractor.model import ModelConfigError
from hsx_extractor.run.failures import RunFailed, describe_failure
from hsx_extractor.run.server_client import ServerUnavailable
from hsx_extractor.run.sources import DatasetError
from hsx_extractor.run.tokens import TokenizerError
from hsx_extractor.run.validate import DumpShapeError
from hsx_extractor.storage.backends import PermanentStoreError, ShardConflictError, TransientStoreError


@pytest.mark.parametrize(
    ("error", "code"),
    [
        # The server runs another model or other layers than the extractor was told: no retry helps.
        (DumpShapeError("dump x: hidden size 64, expected 128"), EXIT_PERMANENT),
        (ModelConfigError("config.json lacks hidden_size"), EXIT_PERMANENT),
        (DatasetError("dataset s3://b/d does not exist"), EXIT_PERMANENT),
        # Found at the first row that needs it (format: auto, no chat template): still configuration.
        (TokenizerError("the tokenizer has no chat template"), EXIT_PERMANENT),
        (PermanentStoreError("access denied"), EXIT_PERMANENT),
        (ShardConflictError("two writers"), EXIT_PERMANENT),
        (TransientStoreError("still 503 after 8 tries"), EXIT_TRANSIENT),
        (ServerUnavailable("connection refused"), EXIT_TRANSIENT),
        (RunFailed("gate tripped", EXIT_PERMANENT), EXIT_PERMANENT),
        (KeyError("surprise"), EXIT_TRANSIENT),
    ],
)
def test_exit_code_of_each_error(error: BaseException, code: int) -> None:
    message, got = describe_failure(error)
    assert got == code
    assert message  # never blank: it becomes lastError and the Failed message


def test_unknown_errors_name_their_type() -> None:
    assert describe_failure(KeyError("x"))[0] == "KeyError: 'x'"
