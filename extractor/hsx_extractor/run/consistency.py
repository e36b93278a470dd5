"""Do the captured final states agree with the model's own predictions?

For a few requests per shard (``validation.consistency``) the extractor also asks the server for the
prompt's top next-token logprobs (SGLang's ``return_logprob`` with ``logprob_start_len`` and
``top_logprobs_num``, answered from the same forward that is captured). The captured final state at
those positions, through the final norm (only when the capture is pre-norm) and the model's lm_head
read from ``modelPath``, must give the server's top tokens with logprobs within tolerance, and rank
no other token above the server's K-th. This catches a capture of the wrong layer, of a partial sum
under tensor parallelism, or of the pre-norm state labelled post-norm; it says nothing about the aux
layers (per-layer norm statistics in each commit record are the view on those).

Pure functions first (what to ask, how to read the answer, how to compare); :class:`Checker` runs
the comparisons of all waiting requests in one pass over the head; :class:`ConsistencyGate` turns
results into the run's verdict.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from hsx_extractor.config import ConsistencySpec
from hsx_extractor.run.lm_head import LmHead, bf16_to_float32

FinalState = Literal["post-norm", "pre-norm"]  # storage.manifest.FINAL_STATES


class CaptureInconsistent(RuntimeError):
    """Too many checked captures disagree with the model's own predictions (permanent: the capture
    itself is wrong, and every retry would capture the same way)."""

    failure_reason = "CaptureInconsistent"


# ---- what to ask --------------------------------------------------------------------------------
class SamplePicks:
    """Which samples are checked: the first ``n`` accepted samples of each shard, in dataset order. Known
    as rows are read (also while the plan is being made), the same on every attempt, and early: a
    capture that disagrees with the model fails the run in its first seconds."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.picked: set[int] = set()
        self._per_shard: dict[int, int] = {}

    def offer(self, shard: int, index: int) -> bool:
        """Sample ``index`` of ``shard`` is accepted; True when it is checked."""
        taken = self._per_shard.get(shard, 0)
        if taken >= self.n:
            return False
        self._per_shard[shard] = taken + 1
        self.picked.add(index)
        return True


def check_positions(length: int, count: int) -> list[int]:
    """Positions whose next-token prediction is compared: ``count`` spread over the last
    ``4 * count`` positions that have a next prompt token (pure). Empty for a 1-token prompt."""
    last = length - 2  # the state at position p predicts token p + 1, which must be in the prompt
    if last < 0:
        return []
    first = max(0, last - 4 * count + 1)
    span = last - first
    if count <= 1 or span == 0:
        return [last]
    return sorted({first + round(span * k / (count - 1)) for k in range(count)})


def logprob_request(positions: Sequence[int], top_k: int) -> dict[str, Any]:
    """Extra /generate fields for a checked request: input logprobs from the first checked position."""
    return {"return_logprob": True, "logprob_start_len": int(positions[0]), "top_logprobs_num": int(top_k)}


TopK = list[tuple[int, float]]  # (token id, logprob), best first


def parse_top_logprobs(body: Mapping[str, Any], start: int, positions: Sequence[int]) -> dict[int, TopK]:
    """The server's top tokens predicted *from* each checked position (pure).

    SGLang's ``meta_info.input_top_logprobs`` has one entry per prompt token from ``start``: entry
    ``j`` is the distribution of token ``start + j``, computed from the state at ``start + j - 1``
    (entry 0 is null); each entry is a list of ``[logprob, token id, text]``."""
    rows = (body.get("meta_info") or {}).get("input_top_logprobs")
    if not isinstance(rows, list):
        raise ValueError("the answer has no meta_info.input_top_logprobs (does the server honour return_logprob?)")
    out: dict[int, TopK] = {}
    for p in positions:
        j = p + 1 - start
        if not 0 < j < len(rows) or not isinstance(rows[j], list) or not rows[j]:
            raise ValueError(f"no top logprobs for position {p} (start {start}, {len(rows)} entries)")
        out[p] = [(int(e[1]), float(e[0])) for e in rows[j]]
    return out


# ---- how to compare -----------------------------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    top = z.max(axis=-1, keepdims=True)
    return z - (top + np.log(np.exp(z - top).sum(axis=-1, keepdims=True)))


@dataclass(frozen=True)
class PositionResult:
    position: int
    ok: bool
    max_error: float  # largest |ours - server| over the server's top tokens
    tolerance: float
    top1_agrees: bool
    detail: str = ""


def compare_position(
    position: int, logits: np.ndarray, server: TopK, atol: float, rtol: float
) -> PositionResult:
    """Our logits (one position, full vocabulary) against the server's top-K (pure).

    Agreement: every server top token's logprob is ours within ``atol + rtol * max|logit|``, and no
    token outside the server's top-K has, by our logits, a logprob above the server's K-th plus
    that tolerance (ties within tolerance may rank either way)."""
    ours = log_softmax(logits[None, :])[0]
    tol = atol + rtol * float(np.abs(logits).max())
    ids = [t for t, _ in server]
    if any(not 0 <= t < ours.shape[0] for t in ids):
        return PositionResult(position, False, float("inf"), tol, False, f"server token outside vocab {ours.shape[0]}")
    errors = [abs(float(ours[t]) - lp) for t, lp in server]
    worst = max(errors)
    kth = min(lp for _, lp in server)
    others = ours.copy()
    others[ids] = -np.inf
    intruder = int(np.argmax(others))
    top1 = int(np.argmax(ours)) == ids[0]
    if worst > tol:
        t, lp = server[errors.index(worst)]
        detail = f"position {position}: token {t} logprob {float(ours[t]):.4f} here, {lp:.4f} at the server"
        return PositionResult(position, False, worst, tol, top1, detail + f" (tolerance {tol:.4f})")
    if float(others[intruder]) > kth + tol:
        detail = (
            f"position {position}: token {intruder} ranks in the top {len(ids)} here "
            f"({float(others[intruder]):.4f}) but not at the server (its #{len(ids)}: {kth:.4f})"
        )
        return PositionResult(position, False, worst, tol, top1, detail)
    return PositionResult(position, True, worst, tol, top1)


@dataclass(frozen=True)
class CheckResult:
    """One checked request."""

    index: int
    ok: bool
    positions: tuple[PositionResult, ...]

    @property
    def max_error(self) -> float:
        return max((p.max_error for p in self.positions), default=0.0)

    @property
    def detail(self) -> str:
        return "; ".join(p.detail for p in self.positions if not p.ok)


@dataclass(frozen=True)
class CheckItem:
    """What one checked request brings: its captured final states at the checked positions."""

    index: int
    states: np.ndarray  # [P, H] bf16 bits (uint16) or float32
    server: dict[int, TopK]  # position -> the server's top-K


def final_rows(hidden_bits: np.ndarray, positions: Sequence[int]) -> np.ndarray:
    """The checked positions' final states, copied out of the dump (pure)."""
    return np.ascontiguousarray(hidden_bits[list(positions)])


def compare_items(
    items: Sequence[CheckItem], head: LmHead, final_state: FinalState, spec: ConsistencySpec
) -> list[CheckResult]:
    """All items through the head in one pass (its rows are read once for the whole batch)."""
    if not items:
        return []
    states = np.concatenate([_as_float(it.states) for it in items])
    if final_state == "pre-norm":
        states = head.final_norm(states)
    logits = head.logits(states)
    results, row = [], 0
    for it in items:
        per = []
        for p in sorted(it.server):
            per.append(compare_position(p, logits[row], it.server[p], spec.logprobTolerance, spec.logprobRelTolerance))
            row += 1
        results.append(CheckResult(it.index, all(r.ok for r in per), tuple(per)))
    return results


def _as_float(states: np.ndarray) -> np.ndarray:
    return bf16_to_float32(states) if states.dtype == np.uint16 else states.astype(np.float32)


# ---- running and judging ------------------------------------------------------------------------
# Requests compared in one pass: bounds the logits held ([MAX_BATCH * positions, vocab] float32,
# 33 MB for 16 x 4 positions at a 129k vocabulary).
MAX_BATCH = 16


class Checker:
    """Compares checked requests in batches: whoever waits while a pass runs joins the next one, so
    the head is read once per pass however many requests are checked (memory: one head block plus
    ``[batch positions, vocab]`` float32 logits)."""

    def __init__(self, head: LmHead, spec: ConsistencySpec, final_state: FinalState) -> None:
        self.head = head
        self.spec = spec
        self.final_state = final_state
        self._waiting: list[tuple[CheckItem, asyncio.Future[CheckResult]]] = []
        self._running: asyncio.Task[None] | None = None
        self._in_pass = 0
        self.passes = 0
        self.seconds = 0.0

    @property
    def backlog(self) -> int:
        """Requests waiting for or in a pass."""
        return len(self._waiting) + self._in_pass

    async def check(self, item: CheckItem) -> CheckResult:
        future: asyncio.Future[CheckResult] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            t0 = loop.time()
            self._in_pass = len(batch)
            try:
                results = await asyncio.to_thread(
                    compare_items, [it for it, _ in batch], self.head, self.final_state, self.spec
                )
            except Exception as exc:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            finally:
                self._in_pass = 0
            self.passes += 1
            self.seconds += loop.time() - t0
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)


@dataclass
class ConsistencyGate:
    """Counts checked requests; the run fails when too many disagree."""

    max_failure_rate: float
    min_checks: int
    checked: int = 0
    failed: int = 0
    last_failure: str = ""

    def record(self, ok: bool, detail: str = "") -> None:
        self.checked += 1
        if not ok:
            self.failed += 1
            self.last_failure = detail

    def add(self, checked: int, failed: int) -> None:
        """Results of shards committed before this process (their commit records)."""
        self.checked += checked
        self.failed += failed

    def verdict(self, final: bool = False) -> str | None:
        """The failure message once the rate is over the limit (early: from min_checks on)."""
        if not self.checked or (not final and self.checked < self.min_checks):
            return None
        if self.failed / self.checked <= self.max_failure_rate:
            return None
        return (
            f"CaptureInconsistent: {self.failed} of {self.checked} checked requests disagree with the model's "
            f"own next-token logprobs (more than validation.consistency.maxFailureRate {self.max_failure_rate:g}); "
            f"the captured final states are not the model's (wrong layer, partial sum, pre/post-norm mix-up?). "
            f"Last: {self.last_failure}. Shards committed so far hold such states: fix the server and start a "
            "new runId"
        )


def summarize(results: Iterable[CheckResult]) -> dict[str, Any]:
    """A shard's checks as its commit record lists them (pure)."""
    done = sorted(results, key=lambda r: r.index)
    return {
        "checked": [r.index for r in done],
        "failed": [r.index for r in done if not r.ok],
        "maxLogprobError": round(max((r.max_error for r in done), default=0.0), 6),
    }


class Consistency:
    """The check as one run uses it: which samples, what to ask, judging answers, per-shard results."""

    def __init__(self, checker: Checker, gate: ConsistencyGate, picks: SamplePicks) -> None:
        self.checker = checker
        self.gate = gate
        self.picks = picks  # filled by the reader thread before it hands a picked sample on
        self.spec = checker.spec
        self.results: dict[int, CheckResult] = {}
        self.skipped = 0

    def plan(self, index: int, length: int) -> list[int]:
        """The positions to check for a sample (empty: not checked). A sample is not checked while
        a full pass of others waits: the check must never hold extraction back (``skipped``)."""
        if index not in self.picks.picked:
            return []
        if self.checker.backlog >= 2 * MAX_BATCH:
            self.skipped += 1
            if self.skipped == 1:
                print(f"hsx: consistency checks fall behind ({self.checker.backlog} waiting): skipping some", flush=True)
            return []
        return check_positions(length, self.spec.positions)

    async def judge(self, index: int, hidden_bits: np.ndarray, positions: Sequence[int], body: Mapping[str, Any]) -> CheckResult:
        """Compare one answered request; raises CaptureInconsistent once the gate says so."""
        try:
            server = parse_top_logprobs(body, positions[0], positions)
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            raise CaptureInconsistent(
                f"CaptureInconsistent: sample {index}: the server's answer cannot be checked ({exc}); a server "
                "that does not return input logprobs needs validation.consistency.samplesPerShard: 0"
            ) from exc
        item = CheckItem(index, final_rows(hidden_bits, positions), server)
        result = await self.checker.check(item)
        self.results[index] = result
        self.gate.record(result.ok, f"sample {index}: {result.detail}")
        verdict = self.gate.verdict()
        if verdict:
            raise CaptureInconsistent(verdict)
        return result

    def shard_summary(self, indices: range) -> dict[str, Any] | None:
        """What the shard's commit record says about its checks (None: none were planned)."""
        if not any(i in self.picks.picked for i in indices):
            return None
        return summarize(self.results[i] for i in indices if i in self.results)
