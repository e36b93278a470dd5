"""Stand-in requests, batches and results that drive SGLang's real prefill result processing."""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tests.sglang.standins import Anything, RealParts

HIDDEN = 8
NUM_LAYERS = 8
# EAGLE-3's default for 8 layers: inputs of layers 2, 4 and 5.
DEFAULT_CAPTURE = (2, 4, 5)


class StandInReq:
    """The attributes of ``schedule_batch.Req`` that the prefill result path reads."""

    def __init__(self, rid: str, ids: list[int], return_hidden_states: Any = True, max_new_tokens: int = 1):
        self.rid = rid
        self.origin_input_ids = array("q", ids)
        self.output_ids = array("q")
        self.return_hidden_states = return_hidden_states
        self.hidden_states: list[Any] = []
        self.inflight_middle_chunks = 0
        self.is_retracted = False
        self.finished_reason: Any = None
        self.to_finish: Any = None
        self.discard_output_reason = None
        self.beam_group = None
        self.grammar = None
        self.finished_len = None
        self.customized_info = None
        self.return_sampling_mask = False
        self.return_logprob = False
        self.return_routed_experts = False
        self.require_reasoning = False
        self.max_new_tokens = max_new_tokens
        self.time_stats = Anything("time_stats")
        self.kv = Anything("kv")

    def finished(self) -> bool:
        return self.finished_reason is not None

    def update_finish_state(self, *args: Any) -> None:
        if self.to_finish is not None:
            self.finished_reason, self.to_finish = self.to_finish, None
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = "length"

    def __getattr__(self, name: str) -> Any:
        return Anything(f"req.{name}")


@dataclasses.dataclass
class Chunk:
    """One request's part of one prefill forward: rows ``[start, end)`` of its prompt."""

    req: StandInReq
    start: int
    end: int
    middle: bool = False  # the scheduler counts this chunk in inflight_middle_chunks


def rows_for(rid: str, length: int, width: int) -> torch.Tensor:
    """Deterministic bf16 rows for a request, so any misplaced row is caught."""
    seed = sum(rid.encode()) * 1000 + width
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(length, width, generator=gen).to(torch.bfloat16)


def expected_bits(rid: str, length: int, width: int) -> np.ndarray:
    return rows_for(rid, length, width).view(torch.int16).numpy().view(np.uint16)


def make_processor(
    module: Any, architecture: str = "LlamaForCausalLM", model: Any = None, num_layers: int = NUM_LAYERS
) -> Any:
    """The real ``SchedulerBatchResultProcessor`` with stand-ins for its collaborators."""
    cls = module.SchedulerBatchResultProcessor
    kwargs: dict[str, Any] = {f.name: Anything(f.name) for f in dataclasses.fields(cls)}
    kwargs.update(
        is_generation=True,
        enable_overlap=False,
        enable_overlap_mlx=False,
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(architectures=[architecture]),
            hf_text_config=SimpleNamespace(num_hidden_layers=num_layers),
            self_opened_think_start_ids=None,
            think_end_ids=None,
        ),
        model_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)),
    )
    return cls(**kwargs)


def run_prefill(
    processor: Any,
    parts: RealParts,
    chunks: list[Chunk],
    k: int = len(DEFAULT_CAPTURE),
    states: Callable[[StandInReq], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """One prefill forward's result through SGLang's real ``process_batch_result_prefill``.

    ``states(req)`` gives a request's whole aux ``[L, K*H]`` and final ``[L, H]`` rows (default:
    deterministic random rows); each chunk contributes its slice, as the model's forward would.
    """

    def synthetic(req: StandInReq) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(req.origin_input_ids)
        return rows_for(req.rid, n, k * HIDDEN), rows_for(req.rid, n, HIDDEN)

    states = states or synthetic
    for c in chunks:
        if c.middle:
            c.req.inflight_middle_chunks += 1  # what Scheduler.get_new_batch_prefill does
    whole = [states(c.req) for c in chunks]
    aux = torch.cat([a[c.start : c.end] for c, (a, _) in zip(chunks, whole, strict=True)])
    final = torch.cat([f[c.start : c.end] for c, (_, f) in zip(chunks, whole, strict=True)])
    # As ScheduleBatch.init_new: the batch asks for states when one of its requests does.
    mode = parts.capture_mode
    per_req = {True: mode.FULL, "last": mode.LAST, False: mode.NULL}
    batch_mode = max(per_req[c.req.return_hidden_states] for c in chunks)
    batch = SimpleNamespace(
        reqs=[c.req for c in chunks],
        return_hidden_states=batch_mode.need_capture(),
        return_hidden_states_mode=batch_mode,
        spec_info=None,
        return_logprob=False,
        decoding_reqs=[],
        spec_algorithm=Anything("spec_algorithm"),
        prefill_stats=None,
        forward_iter=0,
    )
    result = SimpleNamespace(
        copy_done=None,
        auxiliary_host_output=None,
        routed_experts_output=None,
        indexer_topk_output=None,
        logits_output=parts.logits_output(
            next_token_logits=None,
            hidden_states=aux,
            last_hidden_states=final,
        ),
        next_token_ids=torch.arange(len(chunks)) + 100,
        extend_input_len_per_req=[c.end - c.start for c in chunks],
        extend_logprob_start_len_per_req=[0] * len(chunks),
        can_run_cuda_graph=False,
    )
    processor.process_batch_result_prefill(batch, result)
