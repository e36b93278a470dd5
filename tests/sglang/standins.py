"""Load SGLang 0.5.23's real batch-result module on a CPU machine without SGLang's dependencies.

What is real and what is a stand-in (be exact, the tests' worth depends on it):

* real: the whole ``batch_result_processor.py`` from the pinned wheel (its class, the method the
  hook patches and ``process_batch_result_prefill``, which calls it); ``CaptureHiddenMode``
  (``forward_batch_info.py``) and ``LogitsProcessorOutput`` (``logits_processor.py``), whose
  class bodies are compiled from the wheel's source; torch and numpy.
* stand-ins: every other ``sglang.*`` module, because importing any of them pulls CUDA kernels,
  orjson, msgspec, triton and more. A stand-in module hands out a falsy, callable placeholder for
  any name, except a few functions given real behaviour below (capture mode, parallel ranks).
  Requests, batches and batch results are stand-in objects with the attributes SGLang reads.
"""

from __future__ import annotations
import __future__

import ast
import dataclasses
import enum
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from hsx_extractor.sglang_hook.launch import TARGET_MODULE

BATCH_RESULT_FILE = "sglang/srt/managers/scheduler_components/batch_result_processor.py"


class Anything:
    """A placeholder that absorbs attribute access and calls and is falsy."""

    def __init__(self, name: str = "anything") -> None:
        self._name = name

    def __getattr__(self, name: str) -> Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Anything:
        return Anything(f"{self._name}()")

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class StandInModule(ModuleType):
    """A module whose every missing attribute is a placeholder (``from x import y`` works)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = Anything(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def real_class(source_file: Path, class_name: str, namespace: dict[str, Any]) -> Any:
    """Compile one class definition (with its decorators) from SGLang's source file."""
    text = source_file.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            segment = "\n".join(text.splitlines()[start - 1 : node.end_lineno])
            flags = __future__.annotations.compiler_flag
            exec(compile(segment, str(source_file), "exec", flags=flags, dont_inherit=True), namespace)
            return namespace[class_name]
    raise LookupError(f"{class_name} not in {source_file}")


@dataclasses.dataclass
class Parallel:
    """What ``get_parallel()`` answers: the hook reads ``attn_tp_rank``."""

    attn_tp_rank: int = 0
    tp_rank: int = 0


@dataclasses.dataclass
class RealParts:
    capture_mode: Any  # the real CaptureHiddenMode enum
    logits_output: Any  # the real LogitsProcessorOutput dataclass
    parallel: Parallel
    features: SimpleNamespace


def _real_parts(src: Path) -> RealParts:
    ns: dict[str, Any] = {"IntEnum": enum.IntEnum, "total_ordering": functools.total_ordering}
    ns.update(dataclasses=dataclasses, torch=torch)
    ns.update({n: getattr(typing, n) for n in ("Optional", "List", "Dict", "Union", "Any", "Tuple")})
    capture_mode = real_class(
        src / "sglang/srt/model_executor/forward_batch_info.py", "CaptureHiddenMode", ns
    )
    logits_output = real_class(src / "sglang/srt/layers/logits_processor.py", "LogitsProcessorOutput", ns)
    features = SimpleNamespace(return_aux_hidden_state_layer_ids=None, aux_hidden_state_capture="eagle3")
    return RealParts(capture_mode, logits_output, Parallel(), features)


def _give_behaviour(modules: dict[str, StandInModule], parts: RealParts) -> None:
    """The few stand-in functions whose answers matter to the code under test."""

    def module(name: str) -> StandInModule:
        return modules.setdefault(name, StandInModule(name))

    fbi = module("sglang.srt.model_executor.forward_batch_info")
    fbi.CaptureHiddenMode = parts.capture_mode  # type: ignore[attr-defined]
    # In extraction mode the server's mode is FULL, so every prefill captures all rows.
    fbi.get_required_capture_hidden_mode = lambda mode, spec_info: mode  # type: ignore[attr-defined]
    fbi.get_server_return_hidden_states_mode = lambda: parts.capture_mode.FULL  # type: ignore[attr-defined]
    module("sglang.srt.layers.logits_processor").LogitsProcessorOutput = parts.logits_output  # type: ignore[attr-defined]
    # No routed-experts or indexer capture is configured, as in an extraction server.
    module("sglang.srt.state_capturer.routed_experts").get_global_experts_capturer = lambda: None  # type: ignore[attr-defined]
    module("sglang.srt.state_capturer.indexer_topk").get_global_indexer_capturer = lambda: None  # type: ignore[attr-defined]
    rc = module("sglang.srt.runtime_context")
    rc.get_parallel = lambda: parts.parallel  # type: ignore[attr-defined]
    rc.get_exec = lambda: SimpleNamespace(features=parts.features)  # type: ignore[attr-defined]


class StandInFinder(importlib.abc.MetaPathFinder):
    """Serves stand-ins for every ``sglang`` module but the target; packages keep their real paths."""

    def __init__(self, src: Path, modules: dict[str, StandInModule]) -> None:
        self.src = src
        self.modules = modules

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == TARGET_MODULE or not (fullname == "sglang" or fullname.startswith("sglang.")):
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(self), is_package=True)


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, finder: StandInFinder) -> None:
        self.finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.finder.modules.setdefault(spec.name, StandInModule(spec.name))

    def exec_module(self, module: ModuleType) -> None:
        module.__path__ = [str(self.finder.src.joinpath(*module.__name__.split(".")))]


@contextmanager
def standin_sglang(src: Path) -> Iterator[RealParts]:
    """Put the stand-in finder in place for the duration; remove every sglang module afterwards."""
    parts = _real_parts(src)
    modules: dict[str, StandInModule] = {}
    _give_behaviour(modules, parts)
    finder = StandInFinder(src, modules)
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    sys.meta_path.insert(0, finder)
    sys.modules.update(modules)
    try:
        yield parts
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def load_batch_result_module(src: Path) -> ModuleType:
    """Execute the real ``batch_result_processor.py`` (inside :func:`standin_sglang`)."""
    spec = importlib.util.spec_from_file_location(TARGET_MODULE, src / BATCH_RESULT_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[TARGET_MODULE] = module
    spec.loader.exec_module(module)
    return module
