"""Where shards go, and the exactly-once commit protocol (same for a local directory and S3).

A shard counts only once its *commit record* exists. Sealing a shard:

1. create the shard object only if absent (S3: multipart completed with ``If-None-Match: *``;
   local: ``link()`` of a finished temp file). Its key holds the shard checksum, so only equal
   content can share it; if it exists, compare headers (the header lists every sample's
   checksum): equal header + size -> success, anything else is a :class:`ShardConflictError`.
2. create the commit record only if absent. This one conditional write decides the shard: an
   existing record must describe the same content (:meth:`ShardCommit.content`: object, range,
   samples, quarantined rows and reasons; free-text details may differ), or the same samples with
   other states, which the loser adopts (``shard_identity``), else :class:`ShardConflictError`.

A writer killed between 1 and 2 leaves an object no record names; the restarted writer may
produce different bytes (GPU kernels are not bit-deterministic), which then land under a
different key and commit normally. :meth:`Store.finalize` deletes such unreferenced objects.

Resume needs no local state: :meth:`Store.committed_shards` lists commit records. The manifest
is written last, by :meth:`Store.finalize`, once every planned shard has a record.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage import failpoints, native
from hsx_extractor.storage.backends import (
    Backend,
    ObjectSource,
    PermanentStoreError,
    ShardConflictError,
    TransientStoreError,
)
from hsx_extractor.storage.commit_record import MAX_COMMIT_BYTES, QuarantineEntry, ShardCommit
from hsx_extractor.storage.layer_stats import combine, layer_norms, sample_norm_sums
from hsx_extractor.storage.layout import MANIFEST_NAME, RunLayout, split_run_uri, validate_name
from hsx_extractor.storage.manifest import build_manifest
from hsx_extractor.storage.shard_format import (
    COMPRESSION_CODECS,
    Allocate,
    NonFiniteValues,
    SampleEntry,
    SampleRecord,
    ShardFormatError,
    ShardHeader,
    decode_sample,
    encode_sample,
    header_length,
    layout_shard,
    parse_header,
)
from hsx_extractor.storage.shard_identity import same_samples
from hsx_extractor.storage.spool import SpooledObject, SpoolFiles, pwrite_all
from hsx_extractor.storage.stored_json import load_json
from hsx_extractor.storage.thread_buffers import read_buffer, thread_planes
from hsx_extractor.storage.token_counts import add_counts, count_masked
from hsx_extractor.storage.uris import open_backend

HEAD_PROBE_BYTES = 64 << 10  # first read of a shard; usually holds the whole header
# plan.json and manifest.json grow with shards (~0.5 KB each; the manifest lists 1000 quarantined rows at most):
# 256 MiB is 500k shards. Beyond it, damage; a writer refuses to store what readers would refuse.
MAX_NAMED_JSON_BYTES = 256 << 20


class ShardBuilder:
    """Collects one shard's samples in a spool file, then seals (encodes, uploads, commits) it.
    Only samples whose hidden states are all finite are stored."""

    def __init__(self, store: Store, shard_index: int, start: int, stop: int | None, codec: str):
        self._store = store
        self.shard_index = shard_index
        self.start = start
        # None while the plan is still being made: the shard's last row is not read yet (end_at).
        self.stop = stop
        self._codec = codec
        self._lock = threading.Lock()
        self._fd: int | None = store.spools.take()
        self._spool_end = 0
        self._entries: dict[int, tuple[SampleEntry, int]] = {}
        self._quarantine: dict[int, QuarantineEntry] = {}
        self._token_counts: dict[int, int] = {}  # over the loss-masked tokens of the samples added
        self._norm_sums: dict[int, np.ndarray] = {}
        self.result: ShardCommit | None = None

    def _claim(self, index: int) -> None:
        if self._fd is None:
            raise RuntimeError(f"shard {self.shard_index} is already sealed or aborted")
        if index < self.start or (self.stop is not None and index >= self.stop):
            raise ValueError(f"sample index {index} is outside shard {self.shard_index} ({self.describe_range()})")
        if index in self._entries or index in self._quarantine:
            raise ValueError(f"sample index {index} was already added to shard {self.shard_index}")

    def add(self, sample: SampleRecord) -> None:
        """Encode and spool one sample; raises NonFiniteValues (adding nothing) when its hidden states hold
        Inf or NaN, counted as the encoding reads them (so validation need not read them first)."""
        planes = thread_planes()
        planes.reuse()  # this thread's previous sample is in its spool already
        encoded = encode_sample(sample, self._codec, planes)  # CPU work outside the lock
        if encoded.non_finite:
            raise NonFiniteValues(sample.index, encoded.non_finite)
        counts = count_masked(sample.input_ids, sample.loss_mask)
        norms = sample_norm_sums(sample.aux_hidden_states, sample.hidden_states, sample.hidden_states.shape[1])
        with self._lock:
            self._claim(sample.index)
            self._norm_sums[sample.index] = norms
            assert self._fd is not None
            pwrite_all(self._fd, encoded.parts, self._spool_end)
            add_counts(self._token_counts, counts)
            self._entries[sample.index] = (encoded.entry, self._spool_end)
            self._spool_end += encoded.entry.length

    def describe_range(self) -> str:
        return f"[{self.start}, {'open' if self.stop is None else self.stop})"

    def end_at(self, stop: int) -> None:
        """Close an open range once the plan cut the shard (its last row was read)."""
        with self._lock:
            if self.stop is not None and self.stop != stop:
                raise ValueError(f"shard {self.shard_index} already ends at {self.stop}, not {stop}")
            beyond = [i for i in (*self._entries, *self._quarantine) if i >= stop]
            if stop <= self.start or beyond:
                raise ValueError(f"shard {self.shard_index} cannot end at {stop}: it starts at {self.start}, holds {beyond[:3]}")
            self.stop = stop

    def quarantine(self, entry: QuarantineEntry) -> None:
        with self._lock:
            self._claim(entry.index)
            self._quarantine[entry.index] = entry

    def seal(
        self, consistency: dict[str, Any] | None = None, source: dict[str, Any] | None = None
    ) -> ShardCommit:
        """Upload and commit (with the run's consistency results for the shard and the rows it was cut
        from, if known). Safe to call again after a failure; a sealed builder returns its commit."""
        with self._lock:
            if self.result is not None:
                return self.result
            if self._fd is None:
                raise RuntimeError(f"shard {self.shard_index} was aborted")
            if self.stop is None:
                raise RuntimeError(f"shard {self.shard_index} is not cut yet: its last row is unknown")
            indices = range(self.start, self.stop)
            missing = [i for i in indices if i not in self._entries and i not in self._quarantine]
            if missing:
                raise ValueError(
                    f"shard {self.shard_index}: {len(missing)} indices neither added nor quarantined, e.g. {missing[:5]}"
                )
            header, placed = layout_shard(self.shard_index, (e for e, _ in self._entries.values()))
            regions = tuple((self._entries[e.index][1], e.length) for e in placed)
            spooled = SpooledObject(header, self._fd, regions)
            shard_checksum = parse_header(header).header_checksum
            commit = ShardCommit(
                shard_index=self.shard_index,
                samples=len(placed),
                quarantined=len(self._quarantine),
                bytes_stored=spooled.size,
                bytes_raw=sum(e.raw_bytes for e in placed),
                key=self._store.layout.shard_key(self.shard_index, shard_checksum),
                checksum=shard_checksum,
                start=self.start,
                stop=self.stop,
                sample_indices=tuple(e.index for e in placed),
                quarantine=tuple(self._quarantine[i] for i in sorted(self._quarantine)),
                token_counts=dict(self._token_counts),
                layer_norms=layer_norms(combine([self._norm_sums[i] for i in sorted(self._norm_sums)])),
                consistency=consistency,
                source=source,
            )
            self.result = self._store.commit_shard(commit, spooled)  # ours, or an equal writer's adopted
            self._close()
            return self.result

    def abort(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            self._store.spools.give_back(self._fd)
            self._fd = None

    def __enter__(self) -> ShardBuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class Store:
    """One run's output: plan, shards, commit records, manifest."""

    def __init__(self, backend: Backend, layout: RunLayout, output: OutputSpec, spool_dir: str | None = None):
        self.backend = backend
        self.layout = layout
        self.output = output
        self.codec = COMPRESSION_CODECS[output.compression]
        self.spools = SpoolFiles(spool_dir)

    def close(self) -> None:
        """Release the spool files kept for reuse."""
        self.spools.close()

    @property
    def description(self) -> str:
        return f"{self.backend.description}/{self.layout.root}"

    # -- small JSON objects -------------------------------------------------------------
    def get_json(self, name: str) -> dict[str, Any] | None:
        try:
            data = self.backend.get(self.layout.key(validate_name(name)), MAX_NAMED_JSON_BYTES)
            if data is None:
                return None
            obj = load_json(data, name, MAX_NAMED_JSON_BYTES)
        except ShardFormatError as exc:
            raise PermanentStoreError(f"{self.description}/{name}: {exc}") from exc
        if not isinstance(obj, dict):
            raise PermanentStoreError(f"{self.description}/{name} is not a JSON object")
        return obj

    def put_json_if_absent(self, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``name`` unless it exists; return what is stored (ours or the earlier one)."""
        key = self.layout.key(validate_name(name))
        body = canonical_json(obj)
        if len(body) > MAX_NAMED_JSON_BYTES:
            raise PermanentStoreError(f"{self.description}/{name} would be {len(body)} bytes, more than readers take "
                                      f"({MAX_NAMED_JSON_BYTES}): too many shards; raise output.shardTargetBytes")  # fmt: skip
        if self.backend.put_if_absent(key, body):
            return json.loads(body)  # type: ignore[no-any-return]
        stored = self.get_json(name)
        if stored is None:
            raise TransientStoreError(
                f"{self.description}/{name}: conditional write refused but the object is gone"
            )
        return stored

    # -- shards ---------------------------------------------------------------------------
    def committed_shards(self) -> set[int]:
        """Shards with a commit record: the ones a restarted run skips."""
        found = set()
        for key in self.backend.list_keys(self.layout.commits_prefix):
            k = self.layout.shard_of_commit_key(key)
            if k is not None:
                found.add(k)
        return found

    def get_commit(self, shard_index: int) -> ShardCommit | None:
        try:
            data = self.backend.get(self.layout.commit_key(shard_index), MAX_COMMIT_BYTES)
            if data is None:
                return None
            commit = ShardCommit.from_bytes(data)
        except ShardFormatError as exc:
            raise PermanentStoreError(
                f"commit record of shard {shard_index} in {self.description} is damaged: {exc}"
            ) from exc
        if commit.shard_index != shard_index:
            raise PermanentStoreError(
                f"commit record of shard {shard_index} in {self.description} is for shard {commit.shard_index}"
            )
        return commit

    def open_shard(self, shard_index: int, indices: range) -> ShardBuilder:
        if indices.step != 1 or indices.start < 0 or len(indices) == 0:
            raise ValueError(
                f"shard {shard_index}: indices must be a non-empty range with step 1, got {indices}"
            )
        self.layout.shard_prefix(shard_index)  # validates the index
        return ShardBuilder(self, shard_index, indices.start, indices.stop, self.codec)

    def open_shard_at(self, shard_index: int, start: int) -> ShardBuilder:
        """A shard whose last row is not known yet (the plan is made while extracting); it is sealed
        after ``end_at``."""
        if start < 0:
            raise ValueError(f"shard {shard_index}: start must be >= 0, got {start}")
        self.layout.shard_prefix(shard_index)
        return ShardBuilder(self, shard_index, start, None, self.codec)

    def abort_stale_uploads(self, shard_index: int | None = None) -> int:
        """Abort unfinished uploads of one shard (or of every shard of this run)."""
        prefix = (
            self.layout.shard_prefix(shard_index) if shard_index is not None else self.layout.shards_prefix
        )
        return self.backend.abort_uploads(prefix)

    def commit_shard(self, commit: ShardCommit, source: ObjectSource) -> ShardCommit:
        """Steps 1 and 2 of the protocol (module docstring); returns the shard's record: ours, or the
        one another writer committed first with the same samples (storage/shard_identity)."""
        self.abort_stale_uploads(commit.shard_index)
        metadata = {"hsx-checksum": commit.checksum, "hsx-format": "hsx-shard/1"}
        if not self.backend.upload_if_absent(commit.key, source, metadata):
            self._check_same_shard(commit)
        failpoints.reach("shard-uploaded")
        record = canonical_json(commit.to_json())
        commit_key = self.layout.commit_key(commit.shard_index)
        if self.backend.put_if_absent(commit_key, record):
            failpoints.reach("record-written")
            return commit
        try:
            existing = self.backend.get(commit_key, MAX_COMMIT_BYTES)
            stored = load_json(existing, "commit record", MAX_COMMIT_BYTES) if existing is not None else None
            theirs_commit = ShardCommit.from_json(stored) if isinstance(stored, dict) else None
        except ShardFormatError:
            stored = theirs_commit = None  # unreadable: a conflict like any other record that is not ours
        if theirs_commit is not None and theirs_commit.content() == commit.content():
            # An identical writer (a duplicate pod, or our own retried request) got there first;
            # only free-text quarantine details (which name request ids) may differ.
            return theirs_commit
        theirs = stored.get("key") if isinstance(stored, dict) else None
        if theirs != commit.key:
            self.backend.delete(commit.key)  # unreferenced: nobody will ever read it
        if theirs_commit is not None and self._same_samples(commit, source, theirs_commit):
            return theirs_commit  # other states of the same samples (GPUs are not bit-deterministic)
        raise ShardConflictError(
            f"commit record {self.backend.description}/{commit_key} already exists with different "
            f"content (it names {theirs!r}, we wrote {commit.key!r}): two writers produced different "
            "data for one shard. Not overwriting; ours was discarded."
        )

    def _same_samples(self, ours: ShardCommit, source: ObjectSource, theirs: ShardCommit) -> bool:
        # Their object is checked against its record as any reader checks it.
        their_read = functools.partial(self.backend.get_range, theirs.key)
        try:
            return same_samples(ours, source, theirs, lambda: self.checked_header(theirs), their_read)
        except (ShardFormatError, PermanentStoreError):
            return False

    def _check_same_shard(self, commit: ShardCommit) -> None:
        size = self.backend.size(commit.key)
        try:
            header = self.read_header(commit.key) if size is not None else None
        except ShardFormatError:
            header = None
        if size != commit.bytes_stored or header is None or header.header_checksum != commit.checksum:
            raise ShardConflictError(
                f"{self.backend.description}/{commit.key} already exists with different content "
                f"(size {size}, expected {commit.bytes_stored}; checksum "
                f"{header.header_checksum if header else 'unreadable'}, expected {commit.checksum}). "
                "Two writers produced different data for one shard; not overwriting."
            )

    # -- reading ----------------------------------------------------------------------------
    def shard_object_key(self, shard: int | str) -> str:
        """The object key of a committed shard (by index, via its commit record, which must name this
        run's own key) or ``shard`` itself."""
        if isinstance(shard, str):
            return shard
        commit = self.get_commit(shard)
        if commit is None:
            raise PermanentStoreError(f"shard {shard} of {self.description} has no commit record")
        try:
            self.check_commit_key(commit)
        except ShardFormatError as exc:
            raise PermanentStoreError(str(exc)) from exc
        return commit.key

    def read_header(self, shard: int | str) -> ShardHeader:
        """The header of a shard object, given its key or the index of a committed shard."""
        key = self.shard_object_key(shard)
        head = self.backend.get_range(key, 0, HEAD_PROBE_BYTES)
        total = header_length(head)
        if total > len(head):
            head += self.backend.get_range(key, len(head), total - len(head))
        return parse_header(head)

    def check_commit_key(self, commit: ShardCommit) -> None:
        """Raise :class:`ShardFormatError` unless the record names this run's own key for its shard
        and checksum: a record must never send a reader to another run's object, or outside the run."""
        expected = self.layout.shard_key(commit.shard_index, commit.checksum)
        if commit.key != expected:
            raise ShardFormatError(
                f"commit record of shard {commit.shard_index} in {self.description} names key "
                f"{commit.key[:300]!r}, not this run's {expected!r}"
            )

    def checked_header(self, commit: ShardCommit) -> ShardHeader:
        """The header of a committed shard, once the record and the object agree: the key is this
        run's for the shard and checksum, the object has the recorded size, the header hashes to the
        recorded shard checksum, names the shard, and lists exactly the recorded samples, which tile
        the object (so no sample read reaches past it)."""
        k = commit.shard_index
        self.check_commit_key(commit)
        size = self.backend.size(commit.key)
        if size is None:
            raise PermanentStoreError(f"shard {k} of {self.description}: object {commit.key} is missing")
        if size != commit.bytes_stored:
            raise ShardFormatError(f"shard {k}: object is {size} bytes, commit record says {commit.bytes_stored}")
        header = self.read_header(commit.key)
        if header.header_checksum != commit.checksum:
            raise ShardFormatError(
                f"shard {k}: header checksum {header.header_checksum}, commit record says {commit.checksum}"
            )
        if header.shard_index != k:
            raise ShardFormatError(f"shard {k}: the object's header is for shard {header.shard_index}")
        if header.object_size != size:
            raise ShardFormatError(f"shard {k}: samples do not tile the object ({header.object_size} != {size} bytes)")
        if tuple(s.index for s in header.samples) != commit.sample_indices:
            raise ShardFormatError(f"shard {k}: header and commit record list different samples")
        return header

    def read_sample(
        self,
        shard: int | str,
        header: ShardHeader,
        entry: SampleEntry,
        verify: bool = True,
        allocate: Allocate | None = None,
    ) -> SampleRecord:
        """One ranged read (shard by key or committed index), then decode (hidden states into buffers from
        ``allocate`` when given); checksummed unless ``verify`` is False."""
        key = self.shard_object_key(shard)
        data = self.backend.get_range_into(key, header.data_start + entry.offset, read_buffer(entry.length))
        # Every array decode_sample returns is its own (decoded or copied), so the buffer is free again.
        return decode_sample(data, entry, verify=verify, allocate=allocate, kernels=native.kernels())

    def unreferenced_shard_objects(self, commits: Iterable[ShardCommit]) -> list[str]:
        """Shard objects no commit record names: left by attempts killed before their record."""
        referenced = {c.key for c in commits}
        return [
            key
            for key in self.backend.list_keys(self.layout.shards_prefix)
            if self.layout.shard_of_key(key) is not None and key not in referenced
        ]

    # -- the end ---------------------------------------------------------------------------
    def finalize(
        self,
        planned: Sequence[tuple[int, int, int]],
        described: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    ) -> dict[str, Any] | None:
        """Write manifest.json once every planned shard ``(index, start, stop)`` is committed; None
        while some are not. The run's plan decides which shards there are; the store only checks.
        ``described``: the manifest's descriptive sections, or what computes them (only when written)."""
        existing = self.get_json(MANIFEST_NAME)
        if existing is not None:
            return existing
        committed = self.committed_shards()
        if any(k not in committed for k, _, _ in planned):
            return None
        commits = []
        for k, start, stop in planned:
            c = self.get_commit(k)
            if c is None:
                return None
            if (c.start, c.stop) != (start, stop):
                raise ShardConflictError(
                    f"shard {k} was committed for indices [{c.start}, {c.stop}) but the plan says [{start}, {stop})"
                )
            commits.append(c)
        self.abort_stale_uploads()
        for key in self.unreferenced_shard_objects(commits):  # every shard is committed: garbage
            self.backend.delete(key)
        sections = described() if callable(described) else described
        failpoints.reach("finalizing")
        manifest = build_manifest(self.layout.run_id, self.output.compression, commits, sections)
        return self.put_json_if_absent(MANIFEST_NAME, manifest)


def open_store(
    output: OutputSpec, run_id: str, spool_dir: str | None = None, *, writing: bool = True
) -> Store:
    """The store of run ``run_id`` under ``output.uri`` (local directory or ``s3://``).

    S3: bad credentials or a missing bucket fail here, before any work; a store opened for
    ``writing`` must also honour ``If-None-Match: *`` (probed), else :class:`PermanentStoreError`;
    a local one must be writable by this process (probed), else the same.
    Readers pass ``writing=False``: they may hold read-only credentials and write nothing."""
    backend, prefix = open_backend(output.uri, output)
    store = Store(backend, RunLayout(prefix, run_id), output, spool_dir)
    preflight = getattr(backend, "preflight", None)
    if preflight is not None:
        preflight(store.layout.root + "/")
    for name in ("probe_conditional_writes", "probe_writable"):
        probe = getattr(backend, name, None)
        if writing and probe is not None:
            probe(store.layout.root + "/")
    return store


def run_location(uri: str, output: OutputSpec | None) -> tuple[OutputSpec, str]:
    """The output spec of the run at ``uri`` (``{output.uri}/{runId}``; ``output`` gives endpoint,
    region and path style) and its runId."""
    output_uri, run_id = split_run_uri(uri)
    spec = output.model_copy(update={"uri": output_uri}) if output else OutputSpec.model_validate({"uri": output_uri})
    return spec, run_id
