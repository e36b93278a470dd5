"""Polling with a clear failure: tests wait on cluster state, never on wall-clock assertions."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.25) -> T:
    """Call `check` until it returns something truthy; AssertionError naming `what` (and the last value) if not."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; last value: {last!r}")
        time.sleep(interval_s)


def get_json(cluster, *args: str) -> dict:
    """`kubectl get ... -o json` as a dict (the kube_cluster fixture's kubectl)."""
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def condition_true(obj: dict, kind: str) -> bool:
    return any(
        c.get("type") == kind and c.get("status") == "True"
        for c in obj.get("status", {}).get("conditions", [])
    )
