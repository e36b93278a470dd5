"""The ExtractionJob's conditions (metav1.Condition) from its phase, and the times status writes
(RFC 3339 in, RFC 3339 and human durations out). Pure functions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Literal

from hsx_operator.status import Condition, ExtractionJobStatus


def rfc3339(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def human_duration(seconds: float | None) -> str:
    """``3725`` -> ``1h2m``; ``65`` -> ``1m5s``; None -> ``""``."""
    if seconds is None or seconds < 0 or math.isnan(seconds) or math.isinf(seconds):
        return ""
    s = round(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    if minutes:
        return f"{minutes}m{s}s"
    return f"{s}s"


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: Literal["True", "False"],
    reason: str,
    message: str,
    generation: int,
    now: datetime,
) -> list[Condition]:
    """Replace one condition; keep lastTransitionTime when its status did not change."""
    old = next((c for c in conditions if c.type == type_), None)
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observedGeneration=generation,
        lastTransitionTime=old.lastTransitionTime if old and old.status == status else rfc3339(now),
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


def conditions_for(
    status: ExtractionJobStatus, stalled: bool, server_ready: bool, generation: int, now: datetime
) -> list[Condition]:
    phase, reason, msg = status.phase, status.reason or status.phase, status.message
    conds = list(status.conditions)

    def put(type_: str, on: bool, why: str, text: str = "") -> None:
        nonlocal conds
        conds = set_condition(conds, type_, "True" if on else "False", why, text, generation, now)

    running = phase in ("Pending", "Starting", "Running")
    put("Reconciling", running, reason if running else phase, msg if running else "")
    put(
        "Stalled",
        stalled or phase == "Failed",
        reason if (stalled or phase == "Failed") else "Progressing",
        msg if stalled or phase == "Failed" else "",
    )
    put("ServerReady", server_ready, "ServerReady" if server_ready else (reason if running else phase))
    put(
        "Succeeded",
        phase == "Succeeded",
        reason if phase == "Succeeded" else phase,
        msg if phase == "Succeeded" else "",
    )
    put("Failed", phase == "Failed", reason if phase == "Failed" else phase, msg if phase == "Failed" else "")
    put("Suspended", phase == "Suspended", reason if phase == "Suspended" else phase)
    return conds
