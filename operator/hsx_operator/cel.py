"""CEL rules (``x-kubernetes-validations``) the spec models share: what the API server refuses at apply time."""

from __future__ import annotations

from typing import Any

from hsx_extractor.config import S3_URI_PATTERN

# A CEL string literal takes a backslash doubled.
_CEL_S3_URI = S3_URI_PATTERN.replace("\\", "\\\\")


def cel(rule: str, message: str, **extra: Any) -> dict[str, Any]:
    """One ``x-kubernetes-validations`` entry."""
    return {"rule": rule, "message": message, **extra}


def location_rules(f: str) -> Any:
    """CEL rules for ``spec.{f}``: a URI and endpoint that mean the same inside the pod."""
    uri, url = f"self.{f}.uri", f"self.{f}.endpoint"
    where = f"{f}.uri must be s3://bucket/key, an absolute path or file:///path: in the pod a relative path "
    scheme = f"!has({url}) || {url}.startsWith('http://') || {url}.startsWith('https://')"
    return [
        cel(f"{uri}.startsWith('s3://') || {uri}.startsWith('/') || {uri}.startsWith('file:///')",
            where + "(or s3:/bucket) names the container's working directory"),
        cel(scheme, f"{f}.endpoint must be an http:// or https:// URL"),
        cel(f"!{uri}.startsWith('s3://') || {uri}.matches('{_CEL_S3_URI}')",
            f"{f}.uri must be s3://bucket/key: a bucket name, no spaces or line breaks"),
    ]  # fmt: skip
