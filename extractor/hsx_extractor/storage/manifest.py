"""The dataset-level manifest: what the data is (run, capture, tokenizer, dataset: given by the
writer) and what the commit records add up to (a pure function of them). docs/format.md."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any, Final

from hsx_extractor import __version__
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.token_counts import counts_to_json, merge_counts

# /2: the capture, tokenizer and dataset facts and the token counts (/1 had none of them).
MANIFEST_VERSION: Final = "hsx-manifest/2"
# The sections that say what the data is, in the order they are written; given by the writer.
DESCRIBED: Final = ("run", "capture", "tokenizer", "dataset")
FINAL_STATES: Final = ("post-norm", "pre-norm")
# Quarantined rows the manifest lists (the first, in dataset order): its size grows with shards, not rows. Every
# shard's commit record lists all of its own; quarantineByReason counts them all.
QUARANTINE_LISTED: Final = 1000
# JSON key -> Capture attribute: the keys every reader may rely on.
CAPTURE_KEYS: Final = {
    "engine": "engine",
    "engineVersion": "engine_version",
    "layerIds": "layer_ids",
    "layerConvention": "layer_convention",
    "finalState": "final_state",
    "dtype": "dtype",
}


class ManifestError(ValueError):
    """A manifest does not say what a reader needs to know (or says it wrongly)."""


@dataclass(frozen=True)
class Capture:
    """How the hidden states were captured (docs/format.md, "capture")."""

    engine: str  # "sglang", or "hsx-reference" for the CPU reference server
    engine_version: str
    layer_ids: tuple[int, ...]  # aux block k holds layer layer_ids[k], numbered by layer_convention
    layer_convention: str  # model.LAYER_CONVENTION for everything hsx writes
    final_state: str  # one of FINAL_STATES: whether the final norm was applied
    dtype: str  # storage dtype of every hidden state

    def to_json(self) -> dict[str, Any]:
        out = {key: getattr(self, attr) for key, attr in CAPTURE_KEYS.items()}
        out["layerIds"] = list(self.layer_ids)
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "manifest") -> Capture:
        """The capture facts, or :class:`ManifestError` naming every key missing or wrong."""
        if not isinstance(obj, Mapping):
            raise ManifestError(f"{where} has no capture facts (capture.{', capture.'.join(CAPTURE_KEYS)})")
        missing = [f"capture.{k}" for k in CAPTURE_KEYS if obj.get(k) is None]
        if missing:
            raise ManifestError(f"{where} lacks {', '.join(missing)}")
        ids = obj["layerIds"]
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise ManifestError(f"{where}: capture.layerIds must be a list of non-negative integers, got {ids!r}")
        if obj["finalState"] not in FINAL_STATES:
            raise ManifestError(f"{where}: capture.finalState {obj['finalState']!r} is not one of {FINAL_STATES}")
        text = {k: obj[k] for k in CAPTURE_KEYS if k != "layerIds"}
        bad = [k for k, v in text.items() if not isinstance(v, str)]
        if bad:
            raise ManifestError(f"{where}: capture.{', capture.'.join(bad)} must be strings")
        return cls(layer_ids=tuple(ids), **{CAPTURE_KEYS[k]: v for k, v in text.items()})


def build_manifest(
    run_id: str, compression: str, commits: Iterable[ShardCommit], described: Mapping[str, Any]
) -> dict[str, Any]:
    """The dataset-level manifest (pure). ``described`` holds the sections of DESCRIBED the writer
    knows (absent ones are written as null); everything else is summed from the commit records."""
    unknown = set(described) - set(DESCRIBED)
    if unknown:
        raise ValueError(f"manifest sections {sorted(unknown)} are not among {DESCRIBED}")
    commits = sorted(commits, key=lambda c: c.shard_index)
    raw = sum(c.bytes_raw for c in commits)
    stored = sum(c.bytes_stored for c in commits)
    counted = [c.token_counts for c in commits]
    counts = None if any(c is None for c in counted) else merge_counts(c for c in counted if c is not None)
    return {
        "format": MANIFEST_VERSION,
        "runId": run_id,
        "hsxVersion": __version__,
        **{name: described.get(name) for name in DESCRIBED},
        "samples": sum(c.samples for c in commits),
        "quarantined": sum(c.quarantined for c in commits),
        "compression": {
            "setting": compression,
            "bytesRaw": raw,
            "bytesStored": stored,
            "ratio": round(raw / stored, 4) if stored else None,
        },
        # Loss-masked token frequencies over every stored sample; null if a shard's record has none.
        "tokenCounts": None if counts is None else {**counts_to_json(counts), "total": sum(counts.values())},
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
        "quarantineByReason": dict(sorted(Counter(q.reason for c in commits for q in c.quarantine).items())),
        "quarantine": [q.to_json() for q in islice((q for c in commits for q in c.quarantine), QUARANTINE_LISTED)],
    }
