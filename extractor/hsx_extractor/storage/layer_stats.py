"""Per-layer statistics of a shard's hidden states: the L2 norm of each token's state, per captured
layer and for the final state (count, mean, std, min, max), listed in the shard's commit record.

They make capture bugs the consistency check cannot see visible in the data itself: an aux layer
captured as a partial sum under tensor parallelism has about 1/sqrt(tp) of its neighbours' norm,
swapped layers break the growth of the residual stream's norm with depth, and a pre-norm final state
has the residual stream's norm instead of the final norm's. Measured on at most ``ROWS_PER_SAMPLE``
evenly spaced tokens of each sample, so it costs little next to encoding the shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROWS_PER_SAMPLE = 64


def sample_norm_sums(aux_bits: np.ndarray, final_bits: np.ndarray, hidden: int) -> np.ndarray:
    """``[K + 1, 5]`` float64 (count, sum, sum of squares, min, max) of token norms, the K aux layers
    in capture order then the final state, over up to ROWS_PER_SAMPLE evenly spaced tokens (pure)."""
    rows = aux_bits.shape[0]
    take = np.unique(np.linspace(0, rows - 1, num=min(rows, ROWS_PER_SAMPLE)).round().astype(np.int64))
    states = np.concatenate([aux_bits[take], final_bits[take]], axis=1)
    x = (states.astype(np.uint32) << 16).view(np.float32).reshape(len(take), -1, hidden)
    norms = np.sqrt(np.einsum("tlh,tlh->lt", x, x, dtype=np.float64))
    return np.stack(
        [np.full(norms.shape[0], norms.shape[1], dtype=np.float64), norms.sum(1), (norms**2).sum(1), norms.min(1), norms.max(1)],
        axis=1,
    )


def combine(parts: list[np.ndarray]) -> np.ndarray | None:
    """Per-sample sums combined (in the caller's order: sample index, so writers agree)."""
    if not parts:
        return None
    total = np.zeros_like(parts[0])
    total[:, 3], total[:, 4] = np.inf, -np.inf
    for p in parts:
        total[:, :3] += p[:, :3]
        total[:, 3] = np.minimum(total[:, 3], p[:, 3])
        total[:, 4] = np.maximum(total[:, 4], p[:, 4])
    return total


def _entry(n: float, s: float, sq: float, lo: float, hi: float) -> dict[str, Any]:
    mean = s / n
    std = max(sq / n - mean * mean, 0.0) ** 0.5
    return {"tokens": int(n), "mean": round(mean, 6), "std": round(std, 6), "min": round(lo, 6), "max": round(hi, 6)}


def layer_norms(total: np.ndarray | None) -> dict[str, Any] | None:
    """Combined sums as the commit record lists them (pure): ``aux``, one entry per aux layer in
    capture order (the manifest's ``capture.layerIds``), and ``final``."""
    if total is None:
        return None
    entries = [_entry(*row) for row in total.tolist()]
    return {"aux": entries[:-1], "final": entries[-1]}


def check_layer_norms(obj: Any) -> dict[str, Any]:
    """A stored ``layerNorms`` value, checked (raises ValueError)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("aux"), list) or len(obj["aux"]) > 1024:
        raise ValueError("layerNorms must be {aux: [...], final: {...}}")
    for e in [*obj["aux"], obj.get("final")]:
        if not isinstance(e, dict) or set(e) != {"tokens", "mean", "std", "min", "max"}:
            raise ValueError("a layerNorms entry must have tokens, mean, std, min, max")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in e.values()):
            raise ValueError("layerNorms values must be numbers")
    return obj
