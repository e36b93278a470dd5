"""How big and how deep one dataset row may be before hsx refuses it unparsed: the bounds that keep a
hostile row from costing gigabytes or a RecursionError (the reader and the parser both ask here)."""

from __future__ import annotations

from typing import Any

from hsx_extractor.run.sources import OversizedRow

# A row is refused unparsed past this many bytes per token of dataset.maxLength (JSON escapes and
# long tokens stay far below it): parsing and tokenizing a 33 MB row first took 7.6 GiB.
ROW_BYTES_PER_TOKEN = 256
MIN_ROW_BYTES_LIMIT = 1 << 20


# Chat rows nest a few levels (tool schemas a few more); the recursive walkers past parsing (template
# rendering, special-token checks) would hit Python's recursion limit near a thousand.
MAX_JSON_DEPTH = 100


def nested_deeper_than(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether lists and objects nest more than ``limit`` levels (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def row_bytes_limit(max_length: int) -> int:
    """Bytes a raw row may have before it is quarantined as too long without being parsed."""
    return max(MIN_ROW_BYTES_LIMIT, ROW_BYTES_PER_TOKEN * max_length)


def row_size(raw: bytes | dict[str, Any] | OversizedRow) -> int:
    """Bytes of a row as read: a line's length, or for a decoded Parquet row the text and items it
    holds (walked without recursion; each cell was bounded by its file, not by hsx)."""
    if isinstance(raw, OversizedRow):
        return raw.size
    if isinstance(raw, bytes | bytearray):
        return len(raw)
    total = 0
    stack: list[Any] = [raw]
    while stack:
        item = stack.pop()
        if isinstance(item, str | bytes | bytearray):
            total += len(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            total += len(item)
            stack.extend(item)
        else:
            total += 1
    return total
