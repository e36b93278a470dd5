"""Reading JSON that was stored: commit records, shard headers, plan and manifest come back from
a bucket anyone with write access may have changed, so nothing read is trusted. Parsing is
bounded (size, nesting, no NaN/Infinity) and every value is checked for type and range, with a
:class:`ShardFormatError` that says which field is wrong. Pure functions; no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

# Bounds on numbers read back: beyond these a value is damage, not data.
MAX_INDEX: Final = 1 << 40  # a dataset position
MAX_BYTES: Final = 1 << 50  # an object size, offset or length (a PiB)
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


class ShardFormatError(ValueError):
    """Stored bytes do not form a valid shard or sample (damage, truncation, bad checksum)."""


def _no_constant(name: str) -> Any:
    raise ShardFormatError(f"{name} is not a JSON number")


def load_json(data: bytes | bytearray | memoryview, what: str, max_bytes: int) -> Any:
    """Parse stored JSON with bounds: at most ``max_bytes``, no NaN/Infinity, nesting limited by
    the interpreter's recursion limit (reported, not raised as RecursionError)."""
    if len(data) > max_bytes:
        raise ShardFormatError(f"{what} is {len(data)} bytes, more than {max_bytes}")
    try:
        return json.loads(bytes(data), parse_constant=_no_constant)
    except RecursionError:
        raise ShardFormatError(f"{what} is nested too deeply") from None
    except ShardFormatError as exc:
        raise ShardFormatError(f"{what}: {exc}") from None
    except ValueError as exc:
        raise ShardFormatError(f"{what} is not JSON: {str(exc)[:200]}") from None


def show(value: Any) -> str:
    if isinstance(value, list | dict):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def json_int(value: Any, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    """A JSON integer in [lo, hi]: not a float (1e9), not a bool, not a string."""
    if type(value) is not int or not lo <= value <= hi:
        raise ShardFormatError(f"{what} must be an integer in [{lo}, {hi}], got {show(value)}")
    return value


def json_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ShardFormatError(f"{what} must be a string, got {show(value)}")
    return value


def json_hex16(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _HEX16.match(value):
        raise ShardFormatError(f"{what} must be 16 lowercase hex digits (xxh3-64), got {show(value)}")
    return value


def json_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ShardFormatError(f"{what} must be a JSON array, got {show(value)}")
    return value


def json_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ShardFormatError(f"{what} must be a JSON object, got {show(value)}")
    return value
