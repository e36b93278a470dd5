"""The dataset-level manifest (a pure function of the commit records)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hsx_extractor import __version__
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.shard_format import MANIFEST_VERSION


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
            | ({"layerNorms": c.layer_norms} if c.layer_norms is not None else {})
            | ({"consistency": c.consistency} if c.consistency is not None else {})
            for c in commits
        ],
        "quarantine": [q.to_json() for c in commits for q in c.quarantine],
    }
