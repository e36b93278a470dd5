"""The wrapper around SGLang 0.5.23's ``SchedulerBatchResultProcessor._append_prefill_hidden_states``.

SGLang calls that method once per request of a prefill batch, in batch order, with the row
offset of the request's rows in ``logits_output.hidden_states`` (aux states ``[T, K*H]`` in
extraction mode) and returns the next offset. ``store`` is true only when the forward's output
is committed: the final chunk of a request that was not retracted or discarded.

For a request with ``return_hidden_states=True`` the wrapper takes over: middle chunks are
staged to host and kept, the final chunk completes the request and hands aux rows, final rows
(``logits_output.last_hidden_states``: after the final norm, or its input with prenorm.py) and
``origin_input_ids`` to the background writer.
SGLang's own ``.tolist()`` path is skipped for it, so the HTTP response carries no hidden states.
Everything else goes to SGLang's original method unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy as np

from hsx_extractor import model, protocol
from hsx_extractor.sglang_hook import prenorm
from hsx_extractor.sglang_hook.launch import HOOK_PRODUCER
from hsx_extractor.sglang_hook.writer import DumpJob, ErrorJob, Staged, stage

log = logging.getLogger("hsx.sglang_hook")

PRODUCER = HOOK_PRODUCER


class Step(Enum):
    """What one call means for one request."""

    ORIGINAL = "original"  # not ours: SGLang's own method handles it
    ELSEWHERE = "elsewhere"  # ours, but another attention-TP rank writes it
    MIDDLE = "middle"  # a middle chunk: keep its rows until the final chunk
    FINAL = "final"  # the last chunk: write the whole request
    DROP = "drop"  # not committed (retracted, discarded, aborted): forget its rows


def classify(req: Any, *, store: bool, full_capture: bool, attn_tp_rank: int) -> Step:
    """Decide what to do with one request's rows in this call (pure)."""
    if req.return_hidden_states is not True or len(req.output_ids) > 0:
        # Not an extraction request, or a decode row (mixed batch) after its prefill was done.
        return Step.ORIGINAL
    if not full_capture:
        return Step.FINAL if store else Step.ORIGINAL
    if attn_tp_rank != 0:
        return Step.ELSEWHERE
    if store:
        return Step.FINAL
    if not req.finished() and not req.is_retracted and req.inflight_middle_chunks > 0:
        return Step.MIDDLE
    return Step.DROP


class Sink(Protocol):
    def submit(self, job: DumpJob | ErrorJob) -> None: ...


@dataclass(frozen=True)
class CaptureInfo:
    """What the server captures, resolved once per process."""

    capture_layers: tuple[int, ...]
    architecture: str


@dataclass
class _Pending:
    aux: list[Staged] = field(default_factory=list)
    final: list[Staged] = field(default_factory=list)


def input_ids_array(ids: Any) -> np.ndarray:
    """``origin_input_ids`` (an ``array('q')`` or a list) as int32, refusing ids that do not fit."""
    wide = np.asarray(ids, dtype=np.int64).reshape(-1)
    if wide.size and (wide.min() < 0 or wide.max() > np.iinfo(np.int32).max):
        raise ValueError("input ids do not fit in int32")
    return wide.astype(np.int32)


def _is_abort(req: Any) -> bool:
    # SGLang replaces an aborted request's ids with one dummy token "to skip the long prefill".
    return type(getattr(req, "to_finish", None)).__name__ == "FINISH_ABORT"


class ExtractionHook:
    """Per-process state: chunks waiting for their final chunk, the writer, resolved capture info."""

    def __init__(
        self,
        sink: Sink,
        attn_tp_rank: Callable[[], int],
        capture_info: Callable[[Any], CaptureInfo],
        final_state: str = protocol.FINAL_POST_NORM,
    ) -> None:
        self._sink = sink
        self.final_state = final_state
        self._attn_tp_rank = attn_tp_rank
        self._resolve_capture = capture_info
        self._capture: CaptureInfo | None = None
        self._rank: int | None = None
        self.pending: dict[str, _Pending] = {}

    def rank(self) -> int:
        if self._rank is None:
            self._rank = int(self._attn_tp_rank())
        return self._rank

    def capture(self, processor: Any) -> CaptureInfo:
        if self._capture is None:
            self._capture = self._resolve_capture(processor)
            log.info(
                "hsx: dumping aux states of layer inputs %s (%s) to the dump directory",
                list(self._capture.capture_layers),
                self._capture.architecture,
            )
        return self._capture

    def _error(self, rid: str, reason: str, message: str) -> None:
        log.error("hsx: %s: %s: %s", rid, reason, message)
        self._sink.submit(ErrorJob(rid, reason, message))

    def on_rows(
        self,
        processor: Any,
        step: Step,
        req: Any,
        logits_output: Any,
        start: int,
        end: int,
    ) -> None:
        """Act on one request's rows ``[start, end)`` of this batch (scheduler thread, no sync)."""
        rid = str(req.rid)
        if step is Step.DROP:
            self.pending.pop(rid, None)
            if not req.is_retracted:
                self._error(rid, "not_committed", "SGLang did not commit this request's prefill output")
            return
        aux_all = logits_output.hidden_states
        final_all = logits_output.last_hidden_states
        if final_all is None:
            self.pending.pop(rid, None)
            why = prenorm.problem() if self.final_state == protocol.FINAL_PRE_NORM else None
            if why is not None:
                self._error(rid, "no_pre_norm_state", why)
            else:
                self._error(
                    rid,
                    "no_final_hidden_states",
                    "logits_output.last_hidden_states is missing: start the server with "
                    "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3",
                )
            return
        aux, final = aux_all[start:end], final_all[start:end]
        pending = self.pending.setdefault(rid, _Pending())
        pending.aux.append(stage(aux))
        pending.final.append(stage(final))
        if step is Step.MIDDLE:
            return
        del self.pending[rid]
        self._finish(processor, req, pending)

    def on_not_full(self, req: Any) -> None:
        self.pending.pop(str(req.rid), None)
        if self.rank() == 0:
            self._error(
                str(req.rid),
                "capture_mode_not_full",
                "hidden states were captured for the last token only: extraction needs full capture "
                "(--enable-return-aux-hidden-states sets --return-hidden-states-mode full)",
            )

    def _finish(self, processor: Any, req: Any, pending: _Pending) -> None:
        rid = str(req.rid)
        if _is_abort(req):
            self._error(rid, "aborted", str(getattr(req.to_finish, "message", req.to_finish)))
            return
        try:
            ids = input_ids_array(req.origin_input_ids)
            info = self.capture(processor)
        except Exception as exc:
            self._error(rid, "hook_error", f"{type(exc).__name__}: {exc}")
            return
        aux_rows = sum(c.rows for c in pending.aux)
        final_rows = sum(c.rows for c in pending.final)
        if not aux_rows == final_rows == len(ids):
            self._error(
                rid,
                "row_count_mismatch",
                f"{aux_rows} aux rows and {final_rows} final rows for {len(ids)} input tokens "
                f"in {len(pending.aux)} chunk(s): a cached prefix (use --disable-radix-cache or a "
                "unique extra_key) or a lost chunk",
            )
            return
        hidden = int(pending.final[0].host.shape[-1])
        aux_width = int(pending.aux[0].host.shape[-1])
        k = len(info.capture_layers)
        if aux_width != k * hidden:
            self._error(
                rid,
                "aux_width_mismatch",
                f"aux rows are {aux_width} wide, expected {k} layers x hidden {hidden}",
            )
            return
        meta = protocol.DumpMeta(
            rid=rid,
            seq_len=len(ids),
            hidden_size=hidden,
            capture_layers=info.capture_layers,
            producer=PRODUCER,
            extra={
                "architecture": info.architecture,
                "source_dtype": str(pending.aux[0].host.dtype).removeprefix("torch."),
                "chunks": str(len(pending.aux)),
                protocol.FINAL_STATE_KEY: self.final_state,
            },
        )
        self._sink.submit(DumpJob(meta=meta, input_ids=ids, aux=pending.aux, final=pending.final))


def make_wrapper(original: Callable[..., int], get_hook: Callable[[], ExtractionHook]) -> Callable[..., int]:
    """A drop-in for ``_append_prefill_hidden_states`` that routes extraction requests to the hook."""

    @functools.wraps(original)
    def _append_prefill_hidden_states(
        self: Any,
        *,
        req: Any,
        logits_output: Any,
        hidden_state_offset: int,
        capture_hidden_mode: Any,
        extend_input_len: int,
        store: bool = True,
    ) -> int:
        def call_original() -> int:
            return original(
                self,
                req=req,
                logits_output=logits_output,
                hidden_state_offset=hidden_state_offset,
                capture_hidden_mode=capture_hidden_mode,
                extend_input_len=extend_input_len,
                store=store,
            )

        if req.return_hidden_states is not True:
            return call_original()
        hook = get_hook()
        full = bool(capture_hidden_mode.is_full())
        step = classify(req, store=store, full_capture=full, attn_tp_rank=hook.rank())
        if step is Step.ORIGINAL:
            return call_original()
        if not full:
            # Only the last token's row exists: nothing to dump. Keep SGLang's offset arithmetic.
            hook.on_not_full(req)
            return call_original()
        end = hidden_state_offset + extend_input_len
        if step is not Step.ELSEWHERE:
            hook.on_rows(self, step, req, logits_output, hidden_state_offset, end)
        return end

    _append_prefill_hidden_states.__hsx_hook__ = True  # type: ignore[attr-defined]
    return _append_prefill_hidden_states


def find_layers_to_capture(model: Any, depth: int = 3) -> list[int] | None:
    """The ``layers_to_capture`` list SGLang's model actually uses, if it can be found."""
    frontier = [model]
    for _ in range(depth + 1):
        found = [getattr(m, "layers_to_capture", None) for m in frontier]
        for value in found:
            if isinstance(value, list | tuple) and value:
                return [int(v) for v in value]
        frontier = [getattr(m, a) for m in frontier for a in ("model", "language_model") if hasattr(m, a)]
    return None


def resolve_capture_info(processor: Any, layer_ids: list[int] | None) -> CaptureInfo:
    """Capture layers from the model config and the server's layer ids, checked against the model."""
    config = processor.model_config
    architecture = (list(getattr(config.hf_config, "architectures", None) or []) or [""])[0]
    num_layers = int(config.hf_text_config.num_hidden_layers)
    computed: list[int] | None
    try:
        computed = model.capture_layers(architecture, num_layers, layer_ids)
    except ValueError as exc:
        computed = None
        log.warning("hsx: %s", exc)
    try:
        actual = find_layers_to_capture(processor.model_worker.model_runner.model)
    except Exception:
        actual = None
    if actual is not None:
        actual = sorted(set(actual))
        if computed is not None and actual != computed:
            log.warning(
                "hsx: the model captures layer inputs %s, hsx_extractor.model says %s for %s; "
                "the dump records what the model captures",
                actual,
                computed,
                architecture,
            )
        return CaptureInfo(tuple(actual), architecture)
    if computed is None:
        raise ValueError(f"cannot tell which layers {architecture} captures for layer ids {layer_ids}")
    return CaptureInfo(tuple(computed), architecture)
