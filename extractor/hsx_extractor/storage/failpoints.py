"""Named steps of the commit protocol (docs/format.md) where a test can kill the process.

``HSX_KILL_AT=<point>[#<n>]`` SIGKILLs this process the n-th time (default: the first) it reaches
``<point>``: a crash exactly between two steps, which random kills hit only by chance. Unset, as in
production, :func:`reach` is a dict lookup. The fault suite kills at every point and resumes
(tests/faults/test_commit_phases.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ENV = "HSX_KILL_AT"
# responses: regenerate (run/regenerate.py), before a shard's capture.
REGENERATE_POINTS = (
    "generated",  # one turn generated, its shard's generations not stored yet
    "generations-stored",  # a shard's generations stored, none of its capture done
)
COMMIT_POINTS = (
    "plan-written",  # plan.json stored (the dataset read to its end; extraction may be under way)
    "part-uploaded",  # one part of a shard's multipart upload sent (S3), the upload open
    "parts-uploaded",  # every part sent, CompleteMultipartUpload not yet
    "shard-uploaded",  # the shard object exists, its commit record does not
    "record-written",  # the commit record stored, the process has not moved on
    "finalizing",  # every shard committed, unreferenced objects deleted, manifest.json not yet
)
POINTS = REGENERATE_POINTS + COMMIT_POINTS


def _parse(value: str) -> tuple[str, int] | None:
    if not value:
        return None
    point, _, nth = value.partition("#")
    if point not in POINTS:
        raise ValueError(f"{ENV}={value!r}: unknown point, expected one of {', '.join(POINTS)}")
    return point, int(nth or 1)


_target = _parse(os.environ.get(ENV, ""))
_seen: dict[str, int] = {}
_lock = threading.Lock()


def reach(point: str) -> None:
    """Mark that the protocol reached ``point``; dies here if the environment asked for it."""
    if _target is None or _target[0] != point:
        return
    with _lock:
        _seen[point] = _seen.get(point, 0) + 1
        if _seen[point] != _target[1]:
            return
    print(f"hsx: {ENV}: killed at {point} #{_target[1]}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
