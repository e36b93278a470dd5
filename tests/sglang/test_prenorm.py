"""Pre-norm capture (sglang_hook/prenorm.py): what it relies on in SGLang 0.5.23's own source, and what
its two patches do around functions shaped like SGLang's. The real server's forward is compared with
transformers in tests/engines/test_sglang_prenorm.py."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from hsx_extractor import protocol
from hsx_extractor.sglang_hook import bootstrap, prenorm
from hsx_extractor.sglang_hook.hook import CaptureInfo, ExtractionHook, Step
from hsx_extractor.sglang_hook.launch import FINAL_STATE_ENV, TARGET_MODULE, server_env
from hsx_extractor.sglang_hook.writer import DumpJob, ErrorJob


def _function(src: Path, module: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((src / (module.replace(".", "/") + ".py")).read_text())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{module}.{name} not found"
    return found[0]


def test_sglang_final_norm_hands_capture_the_norm_input_on_every_path(sglang_src: Path) -> None:
    fn = _function(sglang_src, prenorm.NORM_MODULE, prenorm.NORM_FUNCTION)
    assert [a.arg for a in fn.args.args] == ["hidden_states", "forward_batch", "layernorm", "capture"]
    calls = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)]
    # The fused MoE handoff and the empty batch call capture themselves; the plain path passes it on.
    assert calls.count("capture(residual)") == 1 and calls.count("capture(hidden_states)") == 1
    assert any(c.startswith("access.final_norm_pair(") and "capture" in c for c in calls), calls
    pair = _function(sglang_src, "sglang.srt.layers.layer_boundary.residual.access", "final_norm_pair")
    pair_src = ast.unparse(pair)
    assert "hidden_states, residual = norm(hidden_states, residual" in pair_src and "capture(residual)" in pair_src
    # Llama and Qwen2 end their stacks there (the tiny test model is a Llama).
    for model in ("llama", "qwen2"):
        assert "residual_batch.final_norm(" in (sglang_src / f"sglang/srt/models/{model}.py").read_text()


def test_sglang_logits_processor_returns_last_hidden_states(sglang_src: Path) -> None:
    tree = ast.parse((sglang_src / (prenorm.LOGITS_MODULE.replace(".", "/") + ".py")).read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == prenorm.LOGITS_CLASS]
    [forward] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    assert "last_hidden_states=last_hidden_states_to_store" in ast.unparse(forward)
    # Stored only in full capture mode, and then it is the whole (post-norm) hidden_states: same rows as the norm.
    [store] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_get_last_hidden_states_to_store"]
    assert "return hidden_states" in ast.unparse(store) and "is_full()" in ast.unparse(store)


class _Norm:
    """RMSNorm shaped like SGLang's fused kernel: adds into the residual in place, returns (normed, residual)."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual.add_(x)
        return residual / residual.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), residual


def _sglang_like_modules() -> tuple[ModuleType, ModuleType]:
    batch = ModuleType(prenorm.NORM_MODULE)

    def final_norm(hidden_states, forward_batch, layernorm, capture=None, *, skip_empty=False):  # type: ignore[no-untyped-def]
        normed, updated = layernorm(hidden_states, forward_batch.residual)
        if capture is not None:
            capture(updated)
        return normed

    batch.final_norm = final_norm  # type: ignore[attr-defined]
    logits = ModuleType(prenorm.LOGITS_MODULE)

    class LogitsProcessor:
        def forward(self, hidden_states: torch.Tensor, full: bool) -> SimpleNamespace:
            return SimpleNamespace(last_hidden_states=hidden_states if full else None)

    logits.LogitsProcessor = LogitsProcessor  # type: ignore[attr-defined]
    return batch, logits


def _forward(batch: ModuleType, logits: ModuleType, x: torch.Tensor, res: torch.Tensor, full: bool = True) -> Any:
    normed = batch.final_norm(x, SimpleNamespace(residual=res), _Norm())
    return logits.LogitsProcessor().forward(normed, full)


def test_patches_put_the_norm_input_where_the_hook_reads_the_final_rows() -> None:
    batch, logits = _sglang_like_modules()
    for name, patch in prenorm.PATCHES.items():
        patch({prenorm.NORM_MODULE: batch, prenorm.LOGITS_MODULE: logits}[name])
        patch({prenorm.NORM_MODULE: batch, prenorm.LOGITS_MODULE: logits}[name])  # idempotent
    x, res = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    want = x + res
    out = _forward(batch, logits, x, res)
    assert torch.equal(out.last_hidden_states, want) and prenorm.problem() is None
    res.zero_()  # the borrowed residual's storage is reused: the stored rows are a copy
    assert torch.equal(out.last_hidden_states, want)
    # A decode forward stores no final rows, and leaves none kept for the next forward.
    assert _forward(batch, logits, x, res, full=False).last_hidden_states is None
    assert logits.LogitsProcessor().forward(x, True).last_hidden_states is None
    assert "did not run through SGLang's residual final_norm" in (prenorm.problem() or "")


def test_rows_that_differ_from_the_output_are_never_stored() -> None:
    rows, why = prenorm.pre_norm_rows(torch.zeros(3, 8), torch.zeros(6, 8))
    assert rows is None and "(3, 8)" in (why or "") and "sequence-parallel" in (why or "")
    rows, why = prenorm.pre_norm_rows(torch.ones(2, 4, dtype=torch.float32), torch.zeros(2, 4, dtype=torch.bfloat16))
    assert why is None and rows is not None and rows.dtype == torch.bfloat16


def test_pre_norm_environment_adds_the_patches_and_labels_the_dumps() -> None:
    env = server_env("/dev/shm/hsx", final_state=protocol.FINAL_PRE_NORM)
    assert env[FINAL_STATE_ENV] == protocol.FINAL_PRE_NORM
    assert FINAL_STATE_ENV not in server_env("/dev/shm/hsx")
    assert set(bootstrap.module_patches(env)) == {TARGET_MODULE, *prenorm.PATCHES}
    assert set(bootstrap.module_patches({})) == {TARGET_MODULE}
    with pytest.raises(ValueError, match="final_state"):
        server_env("/dev/shm/hsx", final_state="prenorm")
    with pytest.raises(RuntimeError, match=FINAL_STATE_ENV):
        bootstrap.module_patches({FINAL_STATE_ENV: "both"})


class _Sink:
    def __init__(self) -> None:
        self.jobs: list[DumpJob | ErrorJob] = []

    def submit(self, job: DumpJob | ErrorJob) -> None:
        self.jobs.append(job)


def _request(rid: str, n: int) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=list(range(n)), to_finish=None, is_retracted=False)


def test_hook_labels_pre_norm_dumps_and_says_why_rows_are_missing() -> None:
    sink = _Sink()
    hook = ExtractionHook(sink, lambda: 0, lambda _p: CaptureInfo((1, 2, 3), "LlamaForCausalLM"), protocol.FINAL_PRE_NORM)
    out = SimpleNamespace(hidden_states=torch.zeros(4, 3 * 8, dtype=torch.bfloat16), last_hidden_states=torch.zeros(4, 8))
    hook.on_rows(None, Step.FINAL, _request("a", 4), out, 0, 4)
    [dump] = sink.jobs
    assert isinstance(dump, DumpJob) and dump.meta.final_state == protocol.FINAL_PRE_NORM
    # A forward the logits patch could not serve (its norm input was never kept) reaches the hook with no rows.
    _, logits = _sglang_like_modules()
    prenorm.patch_logits_module(logits)
    unserved = logits.LogitsProcessor().forward(torch.zeros(4, 8), True)
    assert unserved.last_hidden_states is None
    hook.on_rows(None, Step.FINAL, _request("b", 4), SimpleNamespace(hidden_states=out.hidden_states,
                 last_hidden_states=unserved.last_hidden_states), 0, 4)  # fmt: skip
    error = sink.jobs[-1]
    assert isinstance(error, ErrorJob) and error.reason == "no_pre_norm_state"
    assert "capture post-norm instead" in error.message


def test_a_bad_final_state_setting_refuses_sglang_instead_of_serving_unhooked(
    sglang_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setattr(bootstrap, "_installed", False)
    monkeypatch.setattr(bootstrap, "installed_sglang_version", lambda: "0.5.23")
    before = list(sys.meta_path)
    try:
        assert bootstrap.install({"SGLANG_HS_DUMP_DIR": str(tmp_path), FINAL_STATE_ENV: "both"})
        [finder] = [f for f in sys.meta_path if f not in before]
        with pytest.raises(bootstrap.HookSettingError, match=FINAL_STATE_ENV):
            finder.find_spec("sglang", None)
    finally:
        sys.meta_path[:] = before
