"""What the hook relies on, read from SGLang 0.5.23's own source (AST of the wheel's files)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hsx_extractor.sglang_hook.launch import (
    SGLANG_VERSION,
    TARGET_CLASS,
    TARGET_KWONLY,
    TARGET_METHOD,
    TARGET_MODULE,
    server_args,
)

SRT = "sglang/srt"


def _tree(src: Path, rel: str) -> ast.Module:
    return ast.parse((src / rel).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} not found"
    return found[0]


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{cls.name}.{name} not found"
    return found[0]


def _sources(node: ast.AST) -> set[str]:
    return {ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.expr)}


def _self_attributes(fn: ast.FunctionDef) -> set[str]:
    return {
        t.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign | ast.AnnAssign)
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


@pytest.fixture(scope="module")
def batch_result(sglang_src: Path) -> ast.ClassDef:
    rel = TARGET_MODULE.replace(".", "/") + ".py"
    return _class(_tree(sglang_src, rel), TARGET_CLASS)


def test_the_wheel_is_the_pinned_release(sglang_src: Path) -> None:
    [metadata] = sglang_src.glob("sglang-*.dist-info/METADATA")
    version = re.search(r"^Version: (.+)$", metadata.read_text(), re.M)
    assert version is not None and version.group(1).strip() == SGLANG_VERSION


def test_target_method_signature(batch_result: ast.ClassDef) -> None:
    fn = _method(batch_result, TARGET_METHOD)
    assert [a.arg for a in fn.args.args] == ["self"]
    assert tuple(a.arg for a in fn.args.kwonlyargs) == TARGET_KWONLY
    defaults = dict(zip([a.arg for a in fn.args.kwonlyargs], fn.args.kw_defaults, strict=True))
    assert defaults["store"] is not None and ast.literal_eval(defaults["store"]) is True
    assert fn.returns is not None and ast.unparse(fn.returns) == "int"


def test_target_method_slices_full_rows_and_uses_tolist(batch_result: ast.ClassDef) -> None:
    """FULL mode: the request's rows are hidden_states[offset : offset + extend_input_len]; the
    JSON path (.tolist()) is what the hook skips."""
    fn = _method(batch_result, TARGET_METHOD)
    src = _sources(fn)
    assert "capture_hidden_mode.is_full()" in src
    assert "logits_output.hidden_states[start:hidden_state_offset]" in src
    assert "req.return_hidden_states" in src
    body = ast.unparse(fn)
    assert "start = hidden_state_offset" in body and "hidden_state_offset += extend_input_len" in body
    assert "return hidden_state_offset" in body
    assert any(isinstance(n, ast.Attribute) and n.attr == "tolist" for n in ast.walk(fn))


def test_call_site_passes_store_only_for_committed_final_chunks(batch_result: ast.ClassDef) -> None:
    fn = _method(batch_result, "process_batch_result_prefill")
    calls = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == TARGET_METHOD
    ]
    assert len(calls) == 1
    keywords = {k.arg: ast.unparse(k.value) for k in calls[0].keywords}
    assert tuple(keywords) == TARGET_KWONLY
    assert keywords["store"] == "should_commit_output and discard_finish_reason is None"
    assert keywords["extend_input_len"] == "extend_input_len_per_req[i]"
    body = ast.unparse(fn)
    assert "hidden_state_offset = 0" in body
    assert "for i, (req, next_token_id) in enumerate(zip(batch.reqs, next_token_ids))" in body
    commit = next(
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "should_commit_output"
    )
    assert ast.unparse(commit.value) == (
        "not req.finished() and (not req.is_retracted) and (req.inflight_middle_chunks <= 0)"
    )
    # A middle chunk is counted down only after the call, so the hook sees it still > 0.
    assert "req.inflight_middle_chunks -= 1" in body
    assert body.index(f"self.{TARGET_METHOD}(") < body.index("req.inflight_middle_chunks -= 1")


def test_processor_is_a_frozen_slotted_dataclass_with_model_access(batch_result: ast.ClassDef) -> None:
    [decorator] = batch_result.decorator_list
    assert ast.unparse(decorator) == "dataclass(kw_only=True, slots=True, frozen=True)"
    fields = {
        n.target.id
        for n in batch_result.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert {"model_config", "model_worker", "is_generation"} <= fields


def test_request_and_output_attributes_the_hook_reads(sglang_src: Path) -> None:
    sb = _tree(sglang_src, f"{SRT}/managers/schedule_batch.py")
    req = _class(sb, "Req")
    assigned = _self_attributes(_method(req, "__init__"))
    for attr in (
        "rid",
        "origin_input_ids",
        "output_ids",
        "return_hidden_states",
        "hidden_states",
        "inflight_middle_chunks",
        "is_retracted",
        "to_finish",
    ):
        assert attr in assigned, attr
    _method(req, "finished")
    abort = _class(sb, "FINISH_ABORT")
    assert "message" in _self_attributes(_method(abort, "__init__"))
    # Aborting swaps the prompt for one dummy token: the hook must not dump that as data.
    assert "self.origin_input_ids = array('q', [0])" in ast.unparse(sb)

    lp = _tree(sglang_src, f"{SRT}/layers/logits_processor.py")
    out = _class(lp, "LogitsProcessorOutput")
    fields = {
        n.target.id for n in out.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert {"hidden_states", "last_hidden_states"} <= fields
    # last_hidden_states is the post-norm final state of every token, kept only for aux capture.
    keep = _method(_class(lp, "LogitsProcessor"), "_get_last_hidden_states_to_store")
    assert "logits_metadata.capture_hidden_mode.is_full()" in ast.unparse(keep)
    assert "return hidden_states" in ast.unparse(keep)


def test_aux_states_are_concatenated_in_capture_order(sglang_src: Path) -> None:
    aux = _tree(sglang_src, f"{SRT}/layers/aux_hidden_states.py")
    pack = next(n for n in aux.body if isinstance(n, ast.FunctionDef) and n.name == "pack_aux_hidden_states")
    assert "torch.cat(aux_hidden_states, dim=-1)" in _sources(pack)


def test_rank_and_layer_ids_come_from_the_runtime_context(sglang_src: Path) -> None:
    scheduler = (sglang_src / f"{SRT}/managers/scheduler.py").read_text()
    assert "get_parallel().attn_tp_rank == 0" in scheduler  # SGLang's own rank-0 gate
    rc = _tree(sglang_src, f"{SRT}/runtime_context.py")
    names = {n.name for n in rc.body if isinstance(n, ast.FunctionDef)}
    assert {"get_parallel", "get_exec"} <= names
    assert '("attn_tp_rank", "attn_tp_size")' in (sglang_src / f"{SRT}/runtime_context.py").read_text()
    lp = (sglang_src / f"{SRT}/layers/logits_processor.py").read_text()
    assert "features = get_exec().features" in lp and "features.return_aux_hidden_state_layer_ids" in lp
    mc = _method(_class(_tree(sglang_src, f"{SRT}/configs/model_config.py"), "ModelConfig"), "__init__")
    assert {"hf_config", "hf_text_config"} <= _self_attributes(mc)
    tp = _class(_tree(sglang_src, f"{SRT}/managers/tp_worker.py"), "BaseTpWorker")
    _method(tp, "model_runner")


def _server_fields(src: Path) -> set[str]:
    fields: set[str] = set()
    for path in (src / f"{SRT}/arg_groups/fields").glob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                fields.add(n.target.id)
    return fields


def test_every_flag_of_extraction_mode_exists_in_the_release(sglang_src: Path) -> None:
    fields = _server_fields(sglang_src)
    argv = server_args("/models/m", 4, 30000, [1, 2, 3], dp=2, context_length=65536)
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) >= 9
    for flag in flags:
        assert flag[2:].replace("-", "_") in fields, flag
    environ = (sglang_src / f"{SRT}/environ.py").read_text()
    assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = EnvBool(False)" in environ
    # The flag that turns capture on without a draft model needs EAGLE3 as the convention and pp 1.
    validation = (sglang_src / f"{SRT}/arg_groups/validation_hook.py").read_text()
    assert '_AUX_HIDDEN_STATE_CAPTURE_METHODS = ("EAGLE3", "DFLASH", "DSPARK")' in validation
    assert "if cfg.pp_size != 1:" in validation


def test_overlap_scheduling_leaves_the_final_states_on_the_device(sglang_src: Path) -> None:
    """Why the hook stages ``last_hidden_states`` itself: SGLang's overlap copy moves only ``hidden_states``."""
    utils = _tree(sglang_src, f"{SRT}/managers/utils.py")
    copy = next(
        n
        for n in ast.walk(utils)
        if isinstance(n, ast.FunctionDef) and n.name == "copy_to_cpu" and n.args.args[1:]
    )
    src = ast.unparse(copy)
    assert "self.logits_output.hidden_states = _async_d2h(" in src
    assert "last_hidden_states" not in src
