"""The final layer's state before the model's final norm (``final_state: pre-norm``) from SGLang 0.5.23.

SGLang gives the hook (hook.py) the final norm's output as ``logits_output.last_hidden_states``.
Trainers that read the residual stream before that norm (speculators) need the norm's input.
SGLang's models (64 of them, Llama and Qwen among them) end their layer stack in
``residual.batch.final_norm(hidden, forward_batch, norm, capture)``, which hands ``capture`` the updated
residual on each of its paths (plain, fused MoE handoff, empty batch): exactly the norm's input. Two
patches, both run in the forward's own thread, one after the other:
the first keeps a copy of that tensor for the forward, the second puts it in ``last_hidden_states`` when the
logits processor returns. Every later step (padding trim, overlap-schedule copies, the hook's row offsets) then
treats it as it treats the post-norm rows.

Switched on by ``SGLANG_HS_FINAL_STATE=pre-norm`` (launch.server_env). A forward whose norm input was not
kept, or whose rows differ from the output's (sequence-parallel norms shard them), gets no final rows at all:
the hook then writes an error marker for its requests with :func:`problem`'s reason, never post-norm rows
labelled pre-norm.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

NORM_MODULE = "sglang.srt.layers.layer_boundary.residual.batch"
NORM_FUNCTION = "final_norm"
LOGITS_MODULE = "sglang.srt.layers.logits_processor"
LOGITS_CLASS = "LogitsProcessor"

_forward = threading.local()  # the current forward's kept norm input (scheduler thread)
_last_problem: str | None = None  # why the last forward had no pre-norm rows, for the hook's error marker


def problem() -> str | None:
    """Why the most recent forward in pre-norm mode produced no final rows (None: it did)."""
    return _last_problem


def wrap_final_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def final_norm(hidden_states: Any, forward_batch: Any, layernorm: Any, capture: Any = None, **kwargs: Any) -> Any:
        def keep(updated: Any) -> None:
            _forward.kept = updated.clone()  # SGLang lends the storage: keep a copy, before anything reuses it
            if capture is not None:
                capture(updated)

        return original(hidden_states, forward_batch, layernorm, keep, **kwargs)

    final_norm.__hsx_hook__ = True  # type: ignore[attr-defined]
    return final_norm


def pre_norm_rows(kept: Any, post_norm: Any) -> tuple[Any, str | None]:
    """The rows to store in place of ``post_norm``: ``kept`` (this forward's own copy) in its dtype, or (None, why not)."""
    if kept is None:
        return None, (
            "the model's final norm did not run through SGLang's residual final_norm, so its input "
            "was not seen: this model cannot give the pre-norm final state (capture post-norm instead)"
        )
    if tuple(kept.shape) != tuple(post_norm.shape):
        return None, (
            f"the final norm's input has shape {tuple(kept.shape)} and its output {tuple(post_norm.shape)} "
            "(a sequence-parallel norm shards its rows): pre-norm capture needs whole rows"
        )
    return kept.to(dtype=post_norm.dtype), None


def wrap_logits_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _last_problem
        try:
            output = original(self, *args, **kwargs)
        finally:
            kept, _forward.kept = getattr(_forward, "kept", None), None
        post_norm = getattr(output, "last_hidden_states", None)
        if post_norm is not None:
            output.last_hidden_states, _last_problem = pre_norm_rows(kept, post_norm)
        return output

    forward.__hsx_hook__ = True  # type: ignore[attr-defined]
    return forward


def patch_norm_module(module: ModuleType) -> None:
    original = getattr(module, NORM_FUNCTION, None)
    if original is None:
        raise RuntimeError(f"hsx SGLang hook: {NORM_MODULE} has no {NORM_FUNCTION} (pre-norm capture)")
    if not getattr(original, "__hsx_hook__", False):
        setattr(module, NORM_FUNCTION, wrap_final_norm(original))


def patch_logits_module(module: ModuleType) -> None:
    cls = getattr(module, LOGITS_CLASS, None)
    original = None if cls is None else cls.__dict__.get("forward")
    if original is None:
        raise RuntimeError(f"hsx SGLang hook: {LOGITS_MODULE} has no {LOGITS_CLASS}.forward (pre-norm capture)")
    if not getattr(original, "__hsx_hook__", False):
        cls.forward = wrap_logits_forward(original)  # type: ignore[union-attr]


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    NORM_MODULE: patch_norm_module,
    LOGITS_MODULE: patch_logits_module,
}
