"""What the engine tests compare: hsx outputs and dumps against a transformers forward of the same ids.

A dump row holds bf16 values; transformers runs the same weights in float32. Capture layer ``j`` is
the input of decoder layer ``j`` = ``hidden_states[j]`` of a transformers forward (0 = embeddings);
the final states are the last element of that tuple, which transformers takes after the final
norm; a pre-norm final state (vLLM's) is the input of the model's final norm, read with a hook. Rounding a float32 value to bf16 moves it by at most half a bf16 step (2^-9 relative), and
the two float32 forwards differ far less than that, so ``rtol = 2^-8`` is one bf16 step of slack.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hsx_extractor import protocol

# The one import of hsx's output reader (it may move in a refactor).
from hsx_extractor.reader import OutputReader

BF16_RTOL = 2.0**-8
BF16_ATOL = 1e-4  # values near zero: float32 differences between the two forwards
HSX = str(Path(sys.executable).with_name("hsx"))  # the project's `hsx` console script


def bf16_to_float(bits: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).astype(np.int16)).view(torch.bfloat16).float()


@dataclass
class Stored:
    index: int
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    aux: np.ndarray  # bf16 bits [L, K*H]
    final: np.ndarray  # bf16 bits [L, H]


def read_output(run_uri: str | Path) -> dict[int, Stored]:
    """Every sample of a finished run (manifest required), by dataset index; each index once."""
    reader = OutputReader(str(run_uri))
    out: dict[int, Stored] = {}
    for position in range(len(reader)):
        rec = reader.read(position)
        assert rec.index not in out, f"sample {rec.index} stored twice"
        out[rec.index] = Stored(
            rec.index,
            rec.sample_id,
            rec.input_ids.tolist(),
            rec.loss_mask.tolist(),
            rec.aux_hidden_states,
            rec.hidden_states,
        )
    return out


def reference_forward(
    hf_model: Any, ids: list[int], capture_layers: list[int], final_state: str = protocol.FINAL_POST_NORM
) -> tuple[Any, Any]:
    """(aux [L, K*H], final [L, H]) in float32 from transformers; ``final_state`` says which final."""
    import torch

    before_norm: list[Any] = []
    hook = hf_model.model.norm.register_forward_hook(lambda _m, args, _out: before_norm.append(args[0]))
    try:
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    hs = out.hidden_states
    aux = torch.cat([hs[j][0] for j in capture_layers], dim=-1)
    if final_state == protocol.FINAL_PRE_NORM:
        (pre,) = before_norm
        return aux, pre[0]
    assert final_state == protocol.FINAL_POST_NORM, final_state
    return aux, hs[-1][0]


def max_rel_excess(got: Any, want: Any) -> float:
    """max(|got - want| - rtol*|want|) over all values (<= BF16_ATOL means within tolerance)."""
    return float(((got - want).abs() - BF16_RTOL * want.abs()).max())


def assert_matches_transformers(
    what: str, ids: list[int], aux_bits: np.ndarray, final_bits: np.ndarray, hf_model: Any,
    capture_layers: list[int], final_state: str = protocol.FINAL_POST_NORM,
) -> dict[str, float]:  # fmt: skip
    """Shapes exact, values within bf16 tolerance of transformers' forward of ``ids``."""
    import torch

    want_aux, want_final = reference_forward(hf_model, ids, capture_layers, final_state)
    hidden = int(want_final.shape[-1])
    length = len(ids)
    assert aux_bits.shape == (length, len(capture_layers) * hidden), f"{what}: aux shape {aux_bits.shape}"
    assert final_bits.shape == (length, hidden), f"{what}: final shape {final_bits.shape}"
    got_aux, got_final = bf16_to_float(aux_bits), bf16_to_float(final_bits)
    torch.testing.assert_close(
        got_aux, want_aux, rtol=BF16_RTOL, atol=BF16_ATOL, msg=lambda m: f"{what} aux: {m}"
    )
    torch.testing.assert_close(
        got_final, want_final, rtol=BF16_RTOL, atol=BF16_ATOL, msg=lambda m: f"{what} final: {m}"
    )
    return {
        "aux_max_abs": float((got_aux - want_aux).abs().max()),
        "final_max_abs": float((got_final - want_final).abs().max()),
    }


def chat_expectation(hf_tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Ids and assistant mask of a chat row, from transformers' own template rendering."""
    enc = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(enc["input_ids"]), [int(m) for m in enc["assistant_masks"]]


def verify_json(run_uri: str | Path) -> dict[str, Any]:
    """``hsx verify RUN --json``; asserts it exits 0."""
    run = subprocess.run([HSX, "verify", str(run_uri), "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"hsx verify failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    return json.loads(run.stdout)  # type: ignore[no-any-return]
