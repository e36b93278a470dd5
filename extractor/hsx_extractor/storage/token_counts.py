"""Token frequencies over loss-masked (trained-on) tokens: what an EAGLE-3 draft vocabulary is
chosen from. Counted per shard from the samples it stores, written in the shard's commit record
(so they are committed exactly once, with the shard), summed into the manifest. Pure functions.

Stored as ``{"ids": [ascending token ids], "counts": [count of each, >= 1]}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from hsx_extractor.storage.stored_json import ShardFormatError, json_dict, json_int, json_list

MAX_TOKEN_ID = (1 << 31) - 1  # input_ids are stored as int32
MAX_COUNT = 1 << 50


def count_masked(input_ids: np.ndarray, loss_mask: np.ndarray) -> dict[int, int]:
    """How often each id occurs where ``loss_mask`` is non-zero."""
    ids, counts = np.unique(np.asarray(input_ids)[np.asarray(loss_mask) != 0], return_counts=True)
    return dict(zip(ids.tolist(), counts.tolist(), strict=True))


def add_counts(into: dict[int, int], more: Mapping[int, int]) -> dict[int, int]:
    """``into`` plus ``more``, in place (and returned)."""
    for token, n in more.items():
        into[token] = into.get(token, 0) + n
    return into


def merge_counts(parts: Iterable[Mapping[int, int]]) -> dict[int, int]:
    merged: dict[int, int] = {}
    for part in parts:
        add_counts(merged, part)
    return merged


def counts_to_json(counts: Mapping[int, int]) -> dict[str, list[int]]:
    ids = sorted(t for t, n in counts.items() if n)
    return {"ids": ids, "counts": [int(counts[t]) for t in ids]}


def counts_from_json(obj: Any, what: str = "tokenCounts") -> dict[int, int]:
    """Stored counts, checked: ids ascending and distinct in int32's range, counts >= 1."""
    obj = json_dict(obj, what)
    try:
        ids = json_list(obj["ids"], f"{what}.ids")
        counts = json_list(obj["counts"], f"{what}.counts")
    except KeyError as exc:
        raise ShardFormatError(f"{what} has no field {exc}") from None
    if len(ids) != len(counts):
        raise ShardFormatError(f"{what}: {len(ids)} ids but {len(counts)} counts")
    out: dict[int, int] = {}
    previous = -1
    for token, n in zip(ids, counts, strict=True):
        token = json_int(token, f"{what} id", 0, MAX_TOKEN_ID)
        if token <= previous:
            raise ShardFormatError(f"{what}: ids are not ascending and distinct")
        out[token] = json_int(n, f"{what} count", 1, MAX_COUNT)
        previous = token
    return out
