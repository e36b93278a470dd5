"""Fixtures: SGLang 0.5.23's real source (from its wheel) and its batch-result module, hooked."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from hsx_extractor.protocol import DUMP_DIR_ENV
from hsx_extractor.sglang_hook import bootstrap
from tests.sglang.standins import RealParts, load_batch_result_module, standin_sglang
from tests.sglang.wheel import unpacked_source


@pytest.fixture(scope="session")
def sglang_src() -> Path:
    return unpacked_source()


@dataclass
class Hooked:
    module: ModuleType  # the real batch_result_processor, patched by the hook
    parts: RealParts
    dump_dir: Path

    def flush(self) -> None:
        hook = bootstrap.process_hook()
        assert hook._sink.flush(30), "the dump writer did not drain"

    def files(self) -> list[str]:
        self.flush()
        return sorted(p.name for p in self.dump_dir.iterdir())


@pytest.fixture
def hooked(sglang_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hooked]:
    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv(DUMP_DIR_ENV, str(dump_dir))
    monkeypatch.setattr(bootstrap, "_hook", None)
    with standin_sglang(sglang_src) as parts:
        module = load_batch_result_module(sglang_src)
        bootstrap.patch_module(module)
        yield Hooked(module, parts, dump_dir)
        if bootstrap._hook is not None:
            bootstrap._hook._sink.flush(30)
