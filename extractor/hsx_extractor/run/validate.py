"""Is this dump the sample that was sent? Pure checks, and the mismatch-rate gate.

A dump is accepted only whole: same ids as sent, one row per token in both tensors, every value
finite. Anything else is a mismatch with its reason; nothing is truncated, padded or re-aligned.
The values are checked here, or (``scan_values=False``) by the shard builder as it encodes them
(storage.shard_format.NonFiniteValues): one read of a dump instead of two.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hsx_extractor.protocol import Dump
from hsx_extractor.reasons import Reason, is_dataset_reason
from hsx_extractor.storage import native
from hsx_extractor.storage.commit_record import QuarantineEntry
from hsx_extractor.storage.compress import count_non_finite


class DumpShapeError(RuntimeError):
    """The server captures another hidden size or layer count than the run planned for (fatal)."""


@dataclass(frozen=True)
class Mismatch:
    """Why a dump cannot be this sample's."""

    reason: Reason
    detail: str


def check_dump(
    rid: str,
    sent_ids: np.ndarray,
    dump: Dump,
    hidden_size: int,
    num_aux: int,
    capture_layers: tuple[int, ...] | None = None,
    producer: str | None = None,
    final_state: str | None = None,
    scan_values: bool = True,
) -> Mismatch | None:
    """None when ``dump`` is exactly the sample sent as ``rid``; otherwise the mismatch. With
    ``scan_values=False`` its values are not checked for Inf/NaN here: the caller stores the dump with a
    shard builder, which refuses them.

    A dump of another shape, of other layers than ``capture_layers``, from another producer than
    ``producer`` or of another final state than ``final_state`` (each when given) raises
    :class:`DumpShapeError`: that is a misconfigured server (another engine than the run's), not a bad sample."""
    meta = dump.meta
    if final_state is not None and meta.final_state != final_state:
        raise DumpShapeError(
            f"dump {rid} holds the {meta.final_state} final state ({meta.producer}); the run expects "
            f"{final_state}: the server is another engine than the run's `engine`, or was started for "
            "another `finalState` (SGLang's hook: SGLANG_HS_FINAL_STATE)"
        )
    layers_differ = capture_layers is not None and tuple(meta.capture_layers) != tuple(capture_layers)
    if meta.hidden_size != hidden_size or meta.num_aux != num_aux or layers_differ:
        raise DumpShapeError(
            f"dump {rid}: hidden size {meta.hidden_size}, capture layers {list(meta.capture_layers)}; "
            f"the run expects hidden size {hidden_size}, "
            + (
                f"capture layers {list(capture_layers)}"
                if capture_layers is not None
                else f"{num_aux} capture layers"
            )
            + " (from /get_model_info, else the model's config and EAGLE-3's default layers)"
        )
    if producer is not None and meta.producer != producer:
        # The manifest names one engine for the whole run: a dump of another is a swapped server.
        raise DumpShapeError(f"dump {rid} was written by {meta.producer!r}; the run's server is {producer!r}")
    if meta.rid != rid:
        return Mismatch(Reason.ID_MISMATCH, f"file for {rid} holds the dump of {meta.rid}")
    length = int(sent_ids.shape[0])
    got = dump.input_ids
    if got.shape[0] != length or not np.array_equal(got, sent_ids):
        first = _first_difference(sent_ids, got)
        return Mismatch(
            Reason.ID_MISMATCH, f"sent {length} ids, server ran {got.shape[0]}; first difference at {first}"
        )
    rows = (dump.aux_hidden_states.shape[0], dump.hidden_states.shape[0])
    if rows != (length, length):
        return Mismatch(Reason.LENGTH_MISMATCH, f"{length} tokens but aux/final rows {rows[0]}/{rows[1]}")
    if not scan_values:
        return None
    kernels = native.kernels()
    bad = count_non_finite(dump.aux_hidden_states, kernels=kernels) + count_non_finite(dump.hidden_states, kernels=kernels)
    if bad:
        return Mismatch(Reason.NON_FINITE, f"{bad} Inf/NaN values")
    return None


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


CAPTURE_ADVICE = (
    "the server's dumps do not match what was sent (check --disable-radix-cache, --chunked-prefill-size -1 and the "
    "hook; the limit is validation.maxMismatchRate)"
)


class MismatchGate:
    """Trips when more than ``max_rate`` of the last ``window`` checked samples mismatched,
    once at least ``min_samples`` were checked."""

    def __init__(self, max_rate: float, window: int, min_samples: int) -> None:
        self.max_rate = max_rate
        self.min_samples = min_samples
        self._recent: deque[bool] = deque(maxlen=window)
        self.checked = 0

    def record(self, mismatched: bool) -> None:
        self._recent.append(mismatched)
        self.checked += 1

    def verdict(self, what: str = "samples mismatched", advice: str = CAPTURE_ADVICE) -> str | None:
        """A message saying why the run must stop, or None."""
        if self.checked < self.min_samples or not self._recent:
            return None
        bad = sum(self._recent)
        rate = bad / len(self._recent)
        if rate > self.max_rate:
            return f"mismatch gate: {bad} of the last {len(self._recent)} {what} ({rate:.1%} > {self.max_rate:.1%}); {advice}"
        return None


# Samples done before the rejection rate may stop a run early: a dataset's first rows can be unlike the rest.
REJECTION_GATE_MIN_SAMPLES = 1000
REJECTION_EXAMPLES = 3


class DatasetRejected(RuntimeError):
    """More of the run's samples were set aside by the dataset checks than validation.maxRejectedRowRate
    allows: the dataset or its settings are wrong (permanent)."""

    failure_reason = "DatasetRejected"


def rejection_verdict(
    quarantined: Mapping[str, int],
    done: int,
    max_rate: float,
    *,
    final: bool,
    examples: Sequence[QuarantineEntry] = (),
) -> str | None:
    """Why the run must stop for its rejected rows (naming the top reasons and example lines), or None.
    Early (not ``final``) only once :data:`REJECTION_GATE_MIN_SAMPLES` samples are done."""
    rejected = {r: n for r, n in quarantined.items() if n and is_dataset_reason(r)}
    count = sum(rejected.values())
    if done == 0 or (not final and done < REJECTION_GATE_MIN_SAMPLES) or count <= max_rate * done:
        return None
    top = ", ".join(f"{r} {n}" for r, n in sorted(rejected.items(), key=lambda rn: -rn[1])[:5])
    shown = [e for e in examples if is_dataset_reason(e.reason)][:REJECTION_EXAMPLES]
    lines = "; ".join(f"line {e.line} ({e.reason}): {e.detail[:200]}" for e in shown)
    return (
        f"DatasetRejected: {count} of {done} samples ({count / done:.1%}) were set aside by the dataset (or generation) checks, "
        f"more than validation.maxRejectedRowRate {max_rate:.0%}: {top}" + (f"; e.g. {lines}" if lines else "")
        + "; fix the dataset or its settings (dataset.format, chatTemplate, maxLength), then change runId"
    )
