"""Test hooks of the CPU reference server (clearly not part of the SGLang API): which requests it
spoils on purpose, and what it saw. Kept apart so reference_server.py holds only what it serves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hsx_extractor import protocol
from hsx_extractor.protocol import ProtocolError

FAULT_KINDS = ("swap", "drop", "truncate", "add_bos", "nan", "error", "drop_response", "abort", "rate_limit")
# Faults of generations (requests that capture nothing): captures are served as ever.
GENERATION_FAULTS = ("abort",)
# Faults answered before a capture runs (_serve_one serves what passes them as ever).
ANSWER_FAULTS = ("rate_limit",)
# Capture faults: a well-formed dump whose final state is not the one the model predicts from.
CAPTURE_FAULTS = ("prenorm", "wrong_layer", "partial_sum")


# ---- test hooks: deliberate misbehaviour --------------------------------------------------------
@dataclass
class FaultPlan:
    """TEST HOOK. Which requests the server spoils, and how.

    A request is faulted when its sample index (from the rid, see protocol.make_rid) is a
    multiple of ``every`` (for rids not made by make_rid: its arrival number). With
    ``first_attempt_only`` a retry of the same sample is served correctly.

    * swap: the rid's file holds another request's dump (ids and states of another prompt)
    * drop: no dump at all     * truncate: one row fewer than tokens
    * add_bos: BOS prepended before running (ids differ from those sent)
    * nan: one value is NaN    * error: an error marker instead of data
    * drop_response: the dump is written, then the connection is cut instead of answering (a
      response lost on the way: the client cannot know the request ran)
    * rate_limit: a 429 answer before anything runs, as a router's rate limit answers (a retry of the
      same sample is a new rid of a later attempt: with ``first_attempt_only`` it is served)
    * abort: a generation (no capture) whose prompt falls on ``every`` (crc32 of its ids: the same rows
      whatever the order they come in) ends with finish_reason abort and no text, as SGLang answers a
      request it aborted; with ``first_attempt_only`` a prompt aborted once is served when asked again
    * prenorm: the final state before the final norm, labelled (as always) post-norm
    * wrong_layer: the final norm applied to the last decoder layer's *input* (one layer short)
    * partial_sum: the last layer's output as half of a tensor-parallel sum, then the final norm
    (the logprobs the server answers are the model's true ones in every case)
    """

    kind: str | None = None
    every: int = 1
    first_attempt_only: bool = False

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in FAULT_KINDS + CAPTURE_FAULTS:
            raise ValueError(f"unknown fault {self.kind!r}; choose from {', '.join(FAULT_KINDS + CAPTURE_FAULTS)}")
        if self.every < 1:
            raise ValueError("fault every must be >= 1")

    def applies(self, rid: str, arrival: int) -> bool:
        if self.kind is None:
            return False
        try:
            _, index, attempt = protocol.parse_rid(rid)
        except ProtocolError:
            return arrival % self.every == 0
        if self.first_attempt_only and attempt > 0:
            return False
        return index % self.every == 0


@dataclass
class Stats:
    """What the server saw; served at GET /hsx_test/stats."""

    in_flight: int = 0
    max_in_flight: int = 0
    requests: int = 0
    generations: int = 0  # requests that generated text (no capture)
    faulted: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "inFlight": self.in_flight,
            "maxInFlight": self.max_in_flight,
            "requests": self.requests,
            "generations": self.generations,
            "faulted": list(self.faulted),
        }
