"""Where a run's objects live. The one place that decides key layout.

Every key is built from validated components, so no input can produce ``..``, an absolute
key, or a key outside ``{prefix}/{runId}/``::

    {prefix}/{runId}/{name}.json    (named objects: the run's plan.json, see run/plan.py)
    {prefix}/{runId}/shards/shard-{k:06d}-{checksum}.safetensors   (checksum: the shard's xxh3-64)
    {prefix}/{runId}/commits/shard-{k:06d}.json
    {prefix}/{runId}/leases/shard-{k:06d}/g{gen:06d}   (who works on shard k: run/leases.py)
    {prefix}/{runId}/leases/shard-{k:06d}/g{gen:06d}.b{beat:08d}.{kind}.{holder}
    {prefix}/{runId}/generations/shard-{k:06d}.jsonl   (responses: regenerate: shard k's generated
                                            conversations, written once, before its capture: run/regenerate.py)
    {prefix}/{runId}/manifest.json          (written last)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from hsx_extractor.config import RUN_ID_PATTERN
from hsx_extractor.usage import UsageError

SHARDS_DIR = "shards"
COMMITS_DIR = "commits"
MANIFEST_NAME = "manifest.json"
SHARD_SUFFIX = ".safetensors"
COMMIT_SUFFIX = ".json"
LEASES_DIR = "leases"
GENERATIONS_DIR = "generations"
LEASE_KINDS = ("claim", "take", "race", "free")
MAX_SHARDS = 1_000_000

# One path segment of a prefix: no dots-only names, no control characters, no backslashes.
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._=+-]{0,254}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_COMMIT_RE = re.compile(r"^shard-(\d{6,7})\.json$")
_SHARD_RE = re.compile(r"^shard-(\d{6,7})-([0-9a-f]{16})\.safetensors$")
_CHECKSUM_RE = re.compile(r"^[0-9a-f]{16}$")
_LEASE_RE = re.compile(
    r"^shard-(\d{6,7})/g(\d{6})(?:\.b(\d{8})\.(" + "|".join(LEASE_KINDS) + r")\.(r\d{1,6}(?:w\d{1,2})?-[0-9a-f]{1,32}))?$"
)
_HOLDER_RE = re.compile(r"^r\d{1,6}(?:w\d{1,2})?-[0-9a-f]{1,32}$")


class InvalidKeyError(UsageError):
    """A key component is unsafe (``..``, absolute, empty segment, odd characters)."""


def validate_prefix(prefix: str) -> str:
    """Normalise an object-key prefix (``a/b``; may be empty) or raise :class:`InvalidKeyError`."""
    if prefix.startswith("/"):
        raise InvalidKeyError(f"prefix {prefix!r} is absolute; give it relative to the bucket")
    stripped = prefix.rstrip("/")
    if not stripped:
        return ""
    for segment in stripped.split("/"):
        if segment in ("", ".", "..") or ".." in segment:
            raise InvalidKeyError(f"prefix {prefix!r} has an unsafe segment {segment!r} (no '..', '.', '//')")
        if not _SEGMENT_RE.match(segment):
            raise InvalidKeyError(
                f"prefix {prefix!r}: segment {segment!r} must be 1-255 of [A-Za-z0-9._=+-], not starting with '.'"
            )
    return stripped


def validate_run_id(run_id: str) -> str:
    if not re.match(RUN_ID_PATTERN, run_id) or run_id in {"_hsx", "manifest"}:
        raise InvalidKeyError(f"runId {run_id!r} must match {RUN_ID_PATTERN}")
    return run_id


def validate_name(name: str) -> str:
    """A single object name under the run (``plan.json``)."""
    if not _NAME_RE.match(name) or ".." in name:
        raise InvalidKeyError(f"object name {name!r} must be 1-128 of [A-Za-z0-9._-] without '..'")
    return name


def validate_shard_index(shard_index: int) -> int:
    if not isinstance(shard_index, int) or not 0 <= shard_index < MAX_SHARDS:
        raise InvalidKeyError(f"shard index {shard_index!r} must be an int in [0, {MAX_SHARDS})")
    return shard_index


@dataclass(frozen=True)
class Location:
    """An output URI split into its store: ``bucket`` is None for a local directory."""

    bucket: str | None
    prefix: str  # validated key prefix (S3) or absolute directory path (local)


def parse_output_uri(uri: str) -> Location:
    """``s3://bucket/prefix`` or a local path / ``file://`` URI."""
    if uri.startswith("s3://"):
        parts = urlsplit(uri)
        bucket = parts.netloc
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise InvalidKeyError(f"bucket {bucket!r} in {uri!r} is not a valid S3 bucket name")
        if parts.query or parts.fragment:
            raise InvalidKeyError(f"{uri!r}: no query or fragment allowed in an s3:// URI")
        return Location(bucket, validate_prefix(parts.path.lstrip("/")))
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    if "://" in path:
        raise InvalidKeyError(f"unsupported URI scheme in {uri!r}; use s3:// or a local path")
    if any(seg == ".." for seg in path.split("/")):
        raise InvalidKeyError(f"local output {uri!r} contains '..'; give a plain path")
    return Location(None, path)


@dataclass(frozen=True)
class RunLayout:
    """Keys of one run, relative to the store root (bucket or local directory)."""

    prefix: str
    run_id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", validate_prefix(self.prefix))
        validate_run_id(self.run_id)

    @property
    def root(self) -> str:
        return f"{self.prefix}/{self.run_id}" if self.prefix else self.run_id

    def key(self, name: str) -> str:
        return f"{self.root}/{validate_name(name)}"

    @property
    def manifest_key(self) -> str:
        return self.key(MANIFEST_NAME)

    @property
    def shards_prefix(self) -> str:
        return f"{self.root}/{SHARDS_DIR}/"

    @property
    def commits_prefix(self) -> str:
        return f"{self.root}/{COMMITS_DIR}/"

    def shard_prefix(self, shard_index: int) -> str:
        """Common prefix of every object shard ``shard_index`` may be stored as."""
        return f"{self.shards_prefix}shard-{validate_shard_index(shard_index):06d}-"

    def shard_key(self, shard_index: int, checksum: str) -> str:
        """Content-addressed: different bytes for one shard never share a key."""
        if not _CHECKSUM_RE.match(checksum):
            raise InvalidKeyError(f"shard checksum {checksum!r} must be 16 lowercase hex digits")
        return f"{self.shard_prefix(shard_index)}{checksum}{SHARD_SUFFIX}"

    def shard_of_key(self, key: str) -> int | None:
        """The shard index a listed shard-object key names; None for anything else."""
        if not key.startswith(self.shards_prefix):
            return None
        m = _SHARD_RE.match(key[len(self.shards_prefix) :])
        return int(m.group(1)) if m else None

    def commit_key(self, shard_index: int) -> str:
        return f"{self.commits_prefix}shard-{validate_shard_index(shard_index):06d}{COMMIT_SUFFIX}"

    def shard_of_commit_key(self, key: str) -> int | None:
        """The shard index a listed commit-record key names; None for anything else."""
        if not key.startswith(self.commits_prefix):
            return None
        m = _COMMIT_RE.match(key[len(self.commits_prefix) :])
        return int(m.group(1)) if m else None

    @property
    def generations_prefix(self) -> str:
        return f"{self.root}/{GENERATIONS_DIR}/"

    def generations_key(self, shard_index: int) -> str:
        return f"{self.generations_prefix}shard-{validate_shard_index(shard_index):06d}.jsonl"

    @property
    def leases_prefix(self) -> str:
        return f"{self.root}/{LEASES_DIR}/"

    def lease_prefix(self, shard_index: int) -> str:
        return f"{self.leases_prefix}shard-{validate_shard_index(shard_index):06d}/"

    def lease_key(self, shard_index: int, generation: int) -> str:
        """Generation ``generation`` of shard ``shard_index``'s lease: created once, by its one holder."""
        return f"{self.lease_prefix(shard_index)}g{generation:06d}"

    def beat_key(self, shard_index: int, generation: int, beat: int, kind: str, holder: str) -> str:
        """The holder's ``beat``-th renewal of that generation (a new object each time)."""
        if kind not in LEASE_KINDS or not _HOLDER_RE.match(holder):
            raise InvalidKeyError(f"lease kind {kind!r} or holder {holder!r} is not valid")
        return f"{self.lease_key(shard_index, generation)}.b{beat:08d}.{kind}.{holder}"

    def parse_lease_key(self, key: str) -> tuple[int, int, tuple[int, str, str] | None] | None:
        """(shard, generation, (beat, kind, holder) or None for the generation object) of a listed
        lease key; None for anything else."""
        if not key.startswith(self.leases_prefix):
            return None
        m = _LEASE_RE.match(key[len(self.leases_prefix) :])
        if m is None:
            return None
        beat = (int(m.group(3)), m.group(4), m.group(5)) if m.group(3) is not None else None
        return int(m.group(1)), int(m.group(2)), beat


def split_run_uri(uri: str) -> tuple[str, str]:
    """A run's URI (``{output.uri}/{runId}``) -> (output URI, runId)."""
    trimmed = uri.rstrip("/")
    parent, sep, run_id = trimmed.rpartition("/")
    if not sep or not parent or parent.endswith(":/"):
        raise InvalidKeyError(f"{uri!r} does not end in a runId: give {{output.uri}}/{{runId}}")
    validate_run_id(run_id)
    return parent, run_id
