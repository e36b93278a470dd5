"""hsx_extractor.model against every EAGLE-3 capture setter in SGLang 0.5.23.

Each architecture's real ``set_eagle3_layers_to_capture`` (found through its class bases in the
wheel's models/) runs on a stand-in model object; what the model's forward then captures (the
layer inputs ``i`` with ``i in layers_to_capture`` while walking the layers, plus the state after
the last layer for the models whose forward does that) must be what hsx_extractor.model says, or model.py
must refuse the ids where SGLang would capture fewer layers than asked.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hsx_extractor import model as layers

N = 16
ID_SETS: list[list[int] | None] = [None, [1, 7, 12], [2, 7, 12], [0, 3, N - 1], [5, 3, 9]]
# Setters that hand the ids to a wrapped language model; checked separately below.
_DELEGATES = "self.language_model"
_DRAFT = re.compile(r"(NextN|Eagle3?|MTP|Mtp|Draft\w*)$")


@functools.cache
def _index(src: Path) -> tuple[dict[tuple[Path | None, str], tuple[ast.ClassDef, Path]], dict[str, Path]]:
    """Model classes by (file, name) and by (None, name), and registered architectures (name -> file)."""
    classes: dict[tuple[Path | None, str], tuple[ast.ClassDef, Path]] = {}
    entries: dict[str, Path] = {}
    for path in sorted((src / "sglang/srt/models").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes[(path, node.name)] = (node, path)
                classes.setdefault((None, node.name), (node, path))
            elif isinstance(node, ast.Assign) and any(
                getattr(t, "id", "") == "EntryClass" for t in node.targets
            ):
                names = node.value.elts if isinstance(node.value, ast.List) else [node.value]
                entries.update({n.id: path for n in names if isinstance(n, ast.Name)})
    return classes, entries


def _setter(src: Path, class_name: str, near: Path | None = None) -> tuple[ast.FunctionDef, Path] | None:
    """The setter a class uses: its own, else its bases' (same file first, as its imports would)."""
    classes = _index(src)[0]
    entry = classes.get((near, class_name)) or classes.get((None, class_name))
    if entry is None:
        return None
    cls, path = entry
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "set_eagle3_layers_to_capture":
            return node, path
    for base in cls.bases:
        if isinstance(base, ast.Name) and (found := _setter(src, base.id, path)):
            return found
    return None


def _compile(fn: ast.FunctionDef, path: Path) -> Any:
    from typing import Optional

    last_rank = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True))
    ns: dict[str, Any] = {"Optional": Optional, "List": list, "get_parallel": lambda: last_rank}
    exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    return ns[fn.name]


class _PassesIdsOn(Exception):
    """The setter hands the raw ids to an inner model this test cannot see."""


class _Model:
    def __init__(self) -> None:
        self.layers_to_capture: list[int] = []
        self.layers = [SimpleNamespace() for _ in range(N)]
        self.start_layer, self.end_layer = 0, N

    def set_eagle3_layers_to_capture(self, ids: list[int] | None) -> None:
        if ids is None:
            raise _PassesIdsOn
        self.layers_to_capture = list(ids)


def _captured(setter: Any, ids: list[int] | None, after_last: bool) -> list[int]:
    config = SimpleNamespace(num_hidden_layers=N, text_config=SimpleNamespace(num_hidden_layers=N))
    target = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), config=config, model=_Model())
    setter(target, None if ids is None else list(ids))
    chosen = set(target.model.layers_to_capture)
    return sorted(j for j in chosen if 0 <= j < N or (after_last and j == N))


def _captures_after_last_layer(path: Path) -> bool:
    text = path.read_text()
    return "self.end_layer in self.layers_to_capture" in text


def test_every_eagle3_setter_agrees_with_layers_py(sglang_src: Path) -> None:
    checked, disagreements, unrunnable = [], [], set()
    for arch, entry_file in _index(sglang_src)[1].items():
        if _DRAFT.search(arch):
            continue  # a draft model's own setter: never an extraction target
        found = _setter(sglang_src, arch, entry_file)
        if found is None or _DELEGATES in ast.unparse(found[0]):
            continue
        setter = _compile(*found)
        after_last = _captures_after_last_layer(entry_file)
        assert after_last == (arch in layers.CAPTURES_AFTER_LAST_LAYER), arch
        for ids in ID_SETS:
            try:
                actual = _captured(setter, ids, after_last)
            except (
                NameError,
                AttributeError,
                _PassesIdsOn,
            ) as exc:  # a global this test lacks, or an opaque inner model
                unrunnable.add(f"{arch}: {type(exc).__name__} {exc}")
                break
            try:
                predicted: list[int] | str = layers.capture_layers(arch, N, ids)
            except ValueError:
                predicted = "refused"
            asked = 3 if ids is None else len(ids)
            # Refusing is right exactly when SGLang would capture fewer layers than named.
            ok = len(actual) < asked if predicted == "refused" else predicted == actual
            if not ok:
                disagreements.append((arch, ids, actual, predicted))
        checked.append(arch)
    assert disagreements == [], "\n".join(map(str, disagreements))
    assert unrunnable == {"MindSporeForCausalLM: _PassesIdsOn "}
    # The families hsx documents are among those checked.
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in checked
    assert layers.DEEPSEEK_STYLE - {"KimiK25ForConditionalGeneration"} <= set(checked)


def test_kimi_k25_hands_ids_to_deepseek_v3(sglang_src: Path) -> None:
    fn, path = _setter(sglang_src, "KimiK25ForConditionalGeneration") or pytest.fail("no setter")
    assert "self.language_model.set_eagle3_layers_to_capture(layer_ids)" in ast.unparse(fn)
    assert "self.language_model = DeepseekV3ForCausalLM(" in path.read_text()
    assert "KimiK25ForConditionalGeneration" in layers.DEEPSEEK_STYLE


def test_deepseek_rule_examples() -> None:
    assert layers.capture_layers("DeepseekV3ForCausalLM", 61, [1, 29, 57]) == [2, 30, 58]
    assert layers.capture_layers("DeepseekV3ForCausalLM", 61, [2, 29, 57]) == [2, 29, 57]
    assert layers.capture_layers("LlamaForCausalLM", 32, [2, 15, 28]) == [3, 16, 29]
