"""Pytest plugin: one tiny model and one real CPU reference server per session, for the run and tools tests.

The reference server is the real ``hsx serve-reference`` subprocess on 127.0.0.1; tests switch
its deliberate faults through its test-hook endpoint and reset them afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.tools.demo import reference_server
from hsx_extractor.tools.tinymodel import build_tiny_model
from tests.run.helpers import RefServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from hsx_extractor.run.tokens import ChatTokenizer

    return ChatTokenizer(tiny_model)


@pytest.fixture(scope="session")
def _session_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefServer]:
    dumps = tmp_path_factory.mktemp("dumps")
    with reference_server(tiny_model, dumps, ["--enable-test-hooks", "--threads", "1"]) as url:
        yield RefServer(url, dumps, tiny_model)


@pytest.fixture
def ref_server(_session_server: RefServer) -> Iterator[RefServer]:
    """The session's reference server, idle and behaving well at the start of each test."""
    _session_server.wait_idle()
    _session_server.set_fault(None)
    yield _session_server
    _session_server.set_fault(None)
