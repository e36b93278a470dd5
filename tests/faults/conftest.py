"""Fixtures of the fault suite: one tiny model per session (built locally, nothing downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hsx_extractor.tools.tinymodel import build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fault-model") / "model")


@pytest.fixture(scope="session")
def fault_tokenizer(fault_model: Path):  # type: ignore[no-untyped-def]
    from hsx_extractor.run.tokens import ChatTokenizer

    return ChatTokenizer(fault_model)
