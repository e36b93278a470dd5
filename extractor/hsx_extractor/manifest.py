"""plan.json's shard layout and the dataset-level manifest (pure functions)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hsx_extractor import __version__
from hsx_extractor.backends import PermanentStoreError
from hsx_extractor.shards import MANIFEST_VERSION, ShardCommit


def plan_shards(plan: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(shard index, start, stop)`` from plan.json's ``shards: [{index, start, stop}]``."""
    try:
        shards = [(int(s["index"]), int(s["start"]), int(s["stop"])) for s in plan["shards"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PermanentStoreError(f"plan.json needs shards: [{{index, start, stop}}, ...]: {exc}") from exc
    if len({k for k, _, _ in shards}) != len(shards):
        raise PermanentStoreError("plan.json lists a shard twice")
    return sorted(shards)


def build_manifest(
    run_id: str, compression: str, commits: Iterable[ShardCommit], run_info: dict[str, Any]
) -> dict[str, Any]:
    """The dataset-level manifest (pure)."""
    commits = sorted(commits, key=lambda c: c.shard_index)
    raw = sum(c.bytes_raw for c in commits)
    stored = sum(c.bytes_stored for c in commits)
    return {
        "format": MANIFEST_VERSION,
        "runId": run_id,
        "hsxVersion": __version__,
        "run": run_info,
        "samples": sum(c.samples for c in commits),
        "quarantined": sum(c.quarantined for c in commits),
        "compression": {
            "setting": compression,
            "bytesRaw": raw,
            "bytesStored": stored,
            "ratio": round(raw / stored, 4) if stored else None,
        },
        "shards": [
            {
                "index": c.shard_index,
                "key": c.key,
                "start": c.start,
                "stop": c.stop,
                "samples": c.samples,
                "quarantined": c.quarantined,
                "bytesStored": c.bytes_stored,
                "bytesRaw": c.bytes_raw,
                "checksum": c.checksum,
            }
            for c in commits
        ],
        "quarantine": [q.to_json() for c in commits for q in c.quarantine],
    }
