"""User errors: what a person gave is wrong, said in one line that names the field or path.

A :class:`UsageError` ends an ``hsx`` command with the permanent exit code and no traceback (in a
pod, the Job does not retry what cannot succeed). Pydantic's reports are translated here, once,
into the spec's dotted field names without its URLs.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

MAX_SHOWN_INPUT = 80
MAX_SHOWN_ERRORS = 8


class UsageError(ValueError):
    """A configuration, path or argument the user must change; the message says what to do."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_INPUT else text[: MAX_SHOWN_INPUT - 3] + "..."


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """``field.path: what is wrong (got VALUE)`` for each error, joined by ``; `` (no pydantic URLs)."""
    parts = []
    for error in exc.errors(include_url=False)[:MAX_SHOWN_ERRORS]:
        field = ".".join(str(p) for p in (prefix, *error["loc"]) if p != "") or "(top level)"
        kind = error["type"]
        if kind == "missing":
            parts.append(f"{field}: required")
        elif kind == "extra_forbidden":
            parts.append(f"{field}: unknown field (check its spelling against the ExtractionJob spec)")
        else:
            message = error["msg"].removeprefix("Value error, ")
            parts.append(f"{field}: {message} (got {_shown(error.get('input'))})")
    more = len(exc.errors()) - MAX_SHOWN_ERRORS
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def user_message(exc: BaseException) -> str:
    """One line for a user error: pydantic's report translated, a file error as path and reason."""
    if isinstance(exc, ValidationError):
        return describe_validation_error(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__
