"""``hsx vocab OUTPUT --draft-vocab-size N``: EAGLE-3's draft vocabulary from the loss-masked token
counts a finished run's manifest holds (docs/format.md, "tokenCounts").

Writes into ``--out`` (default ``./vocab-{runId}``), for a target vocabulary of V ids:

* ``vocab_mapping.pt``: ``{"d2t": int64 [N], "t2d": bool [V]}`` saved with ``torch.save``, the file
  SpecForge's ``--vocab-mapping`` takes (``load_vocab_mapping``: ``torch.load``, then ``copy_`` into
  the draft model's ``d2t``/``t2d`` buffers of those dtypes and shapes);
* ``d2t.npy`` and ``t2d.npy``: the same arrays with ``numpy.save``, as speculators' ``train.py``
  loads them (``--d2t-path``/``--t2d-path``, or found in its ``--data-path``);
* ``token_freq.pt``: ``{token id: count}`` saved with ``torch.save``, speculators' frequency file;
* ``d2t.pt``: the bare int64 ``d2t`` tensor saved with ``torch.save``, Model-Optimizer's
  ``data.draft_vocab_cache`` (``HFEagleModel.load_draft_vocab_cache``: ``torch.load``, shape and dtype
  checked against the draft's ``d2t`` buffer, then ``copy_``).

``t2d[i]`` is True for the N draft tokens; draft token k is target id ``k + d2t[k]`` (draft ids in
ascending target order). The N tokens are the most frequent, ties to the lower id; when fewer than
N distinct tokens were counted the lowest ids not chosen fill up, as both trainers do.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hsx_extractor.config import OutputSpec, check_local_directory
from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.storage.backends import StoreError
from hsx_extractor.storage.layout import MANIFEST_NAME
from hsx_extractor.storage.store import open_store, run_location
from hsx_extractor.storage.stored_json import ShardFormatError
from hsx_extractor.storage.token_counts import counts_from_json

MAPPING_FILE = "vocab_mapping.pt"
D2T_FILE, T2D_FILE, FREQ_FILE = "d2t.npy", "t2d.npy", "token_freq.pt"
MODELOPT_D2T_FILE = "d2t.pt"


class VocabError(ValueError):
    """The run cannot give a draft vocabulary (no manifest, no counts, sizes that do not fit)."""


def draft_tokens(counts: Mapping[int, int], draft_size: int, target_size: int) -> np.ndarray:
    """The ``draft_size`` chosen target ids, ascending (int64)."""
    if not 1 <= draft_size <= target_size:
        raise VocabError(f"draft vocab size {draft_size} must be in [1, target vocab size {target_size}]")
    outside = [t for t in counts if not 0 <= t < target_size]
    if outside:
        raise VocabError(f"counted token ids {sorted(outside)[:5]} are outside the target vocab of {target_size}")
    chosen = sorted(counts, key=lambda t: (-counts[t], t))[:draft_size]
    taken = set(chosen)
    filler = (t for t in range(target_size) if t not in taken)
    chosen += [next(filler) for _ in range(draft_size - len(chosen))]
    return np.array(sorted(chosen), dtype=np.int64)


def vocab_mapping(
    counts: Mapping[int, int], draft_size: int, target_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t int64 [N], t2d bool [V])`` (pure)."""
    chosen = draft_tokens(counts, draft_size, target_size)
    t2d = np.zeros(target_size, dtype=np.bool_)
    t2d[chosen] = True
    return chosen - np.arange(draft_size, dtype=np.int64), t2d


def run_counts(uri: str, output: OutputSpec | None = None) -> tuple[dict[int, int], dict[str, Any]]:
    """The merged token counts and the manifest of the finished run at ``uri``."""
    spec, run_id = run_location(uri, output)
    store = open_store(spec, run_id, writing=False)
    manifest = store.get_json(MANIFEST_NAME)
    if manifest is None:
        raise VocabError(f"{uri} has no manifest.json: the run is not finished")
    stored = manifest.get("tokenCounts")
    if stored is None:
        raise VocabError(
            f"{uri}/{MANIFEST_NAME} (format {manifest.get('format')!r}) holds no token counts: the run was "
            "written before hsx counted them"
        )
    try:
        counts = counts_from_json(stored, "manifest tokenCounts")
    except ShardFormatError as exc:
        raise VocabError(f"{uri}/{MANIFEST_NAME}: {exc}") from exc
    if stored.get("total") != sum(counts.values()):
        raise VocabError(f"{uri}/{MANIFEST_NAME}: tokenCounts.total disagrees with its counts")
    return counts, manifest


def write_vocab(
    uri: str, draft_size: int, out: str | Path | None = None, target_size: int | None = None
) -> dict[str, Any]:
    """Write the draft vocabulary files of the run at ``uri``; returns what was written."""
    chosen = None if out is None else check_local_directory(str(out), "--out")
    counts, manifest = run_counts(uri)
    recorded = (manifest.get("run") or {}).get("vocabSize")
    if target_size is not None and recorded is not None and target_size != recorded:
        raise VocabError(f"--target-vocab-size {target_size}, but the run's model has {recorded} ids")
    target = target_size or recorded
    if not isinstance(target, int):
        raise VocabError(f"{uri}: the manifest does not give the model's vocab size; pass --target-vocab-size")
    d2t, t2d = vocab_mapping(counts, draft_size, target)
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - the extractor image
        raise VocabError("hsx vocab writes torch files: install torch (the trainer's environment has it)") from exc
    where = chosen or Path(f"vocab-{manifest.get('runId', 'run')}")
    where.mkdir(parents=True, exist_ok=True)
    torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, where / MAPPING_FILE)
    np.save(where / D2T_FILE, d2t)
    np.save(where / T2D_FILE, t2d)
    torch.save(dict(sorted(counts.items())), where / FREQ_FILE)
    torch.save(torch.from_numpy(d2t), where / MODELOPT_D2T_FILE)
    total = sum(counts.values())
    covered = sum(counts.get(int(t), 0) for t in np.flatnonzero(t2d))
    return {
        "out": str(where),
        "files": [MAPPING_FILE, D2T_FILE, T2D_FILE, FREQ_FILE, MODELOPT_D2T_FILE],
        "draftVocabSize": draft_size,
        "targetVocabSize": target,
        "distinctTokens": len(counts),
        "maskedTokens": total,
        "coverage": round(covered / total, 6) if total else None,
    }


def cmd_vocab(args: argparse.Namespace) -> int:
    try:
        summary = write_vocab(args.output, args.draft_vocab_size, args.out, args.target_vocab_size)
    except (VocabError, StoreError) as exc:
        print(f"hsx vocab: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_PERMANENT
    print(json.dumps(summary), flush=True)
    return EXIT_OK


def add_vocab_command(sub: Any) -> None:
    p = sub.add_parser("vocab", help="EAGLE-3 draft vocabulary (d2t/t2d) from a run's loss-masked token counts")
    p.add_argument("output", help="the run's output: {output.uri}/{runId} (directory or s3://)")
    p.add_argument("--draft-vocab-size", type=int, required=True, metavar="N")
    p.add_argument("--out", default=None, help="directory for the files (default ./vocab-{runId})")
    p.add_argument(
        "--target-vocab-size", type=int, default=None, help="the model's vocab size, if the manifest lacks it"
    )
    p.set_defaults(func=cmd_vocab)
