"""``hsx verify``: re-read a committed output and check every claim it makes.

For each commit record: the shard object exists with the recorded size, its header hashes to
the recorded shard checksum and lists exactly the recorded samples, the shard's index range is
covered by samples plus quarantined rows, and every sample (or a sampled fraction) matches its
xxh3-64 and decodes. Across shards: no sample index twice, plan.json fully committed, manifest
consistent with the commit records. Works on local directories and ``s3://``.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hsx_extractor.config import OutputSpec, check_uri
from hsx_extractor.run.plan import PLAN_NAME, PlanMismatch, planned_shards
from hsx_extractor.storage import native
from hsx_extractor.storage.backends import PermanentStoreError, StoreError
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.layout import MANIFEST_NAME, InvalidKeyError, split_run_uri
from hsx_extractor.storage.manifest import DESCRIBED, QUARANTINE_LISTED, build_manifest
from hsx_extractor.storage.shard_format import (
    ShardFormatError,
    ShardHeader,
    checksum,
    decode_sample,
)
from hsx_extractor.storage.store import Store, open_store
from hsx_extractor.storage.token_counts import add_counts, count_masked
from hsx_extractor.storage.uris import open_backend
from hsx_extractor.usage import UsageError

STREAM_CHUNK = 16 << 20
MAX_LISTED_ERRORS = 50


@dataclass
class VerifyReport:
    """What verify found. ``ok`` is True only when ``errors`` is empty."""

    uri: str
    shards_committed: int = 0
    shards_planned: int | None = None
    samples: int = 0  # samples listed by commit records
    samples_checked: int = 0  # samples whose bytes were re-read and checksummed
    quarantined: int = 0
    duplicates: int = 0  # sample indices committed more than once
    bytes_stored: int = 0
    bytes_raw: int = 0
    manifest: bool = False
    sample_fraction: float | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, message: str) -> None:
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append(message)
        elif len(self.errors) == MAX_LISTED_ERRORS:
            self.errors.append("... more errors not listed")

    def to_dict(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "ok": self.ok,
            "shardsCommitted": self.shards_committed,
            "shardsPlanned": self.shards_planned,
            "samples": self.samples,
            "samplesChecked": self.samples_checked,
            "quarantined": self.quarantined,
            "duplicates": self.duplicates,
            "bytesStored": self.bytes_stored,
            "bytesRaw": self.bytes_raw,
            "compressionRatio": round(self.bytes_raw / self.bytes_stored, 4) if self.bytes_stored else None,
            "manifest": self.manifest,
            "sampleFraction": self.sample_fraction,
            "errors": self.errors,
            "warnings": self.warnings,
        }

    def summary_text(self) -> str:
        d = self.to_dict()
        lines = [
            f"{'OK' if self.ok else 'FAILED'}: {self.uri}",
            f"  shards {self.shards_committed} committed / {self.shards_planned if self.shards_planned is not None else '?'} planned, "
            f"manifest {'present' if self.manifest else 'absent'}",
            f"  samples {self.samples} ({self.samples_checked} re-read and checksummed), quarantined {self.quarantined}, "
            f"duplicates {self.duplicates}",
            f"  bytes stored {self.bytes_stored}, raw {self.bytes_raw}, ratio {d['compressionRatio']}",
        ]
        lines += [f"  error: {e}" for e in self.errors]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def run_verify(
    uri: str, sample_fraction: float | None = None, output: OutputSpec | None = None, seed: int = 0
) -> VerifyReport:
    """Verify the run at ``uri`` (``{output.uri}/{runId}``). ``sample_fraction`` in (0, 1]
    re-reads only that share of samples per shard (ranged reads); None re-reads all of them."""
    if sample_fraction is not None and not 0 < sample_fraction <= 1:
        raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction}")
    output_uri, run_id = split_run_uri(uri)
    spec = (
        output.model_copy(update={"uri": output_uri})
        if output
        else OutputSpec.model_validate({"uri": output_uri})
    )
    report = VerifyReport(uri=uri, sample_fraction=sample_fraction)
    try:
        store = open_store(spec, run_id, writing=False)
        _verify(store, report, sample_fraction, random.Random(seed))
    except StoreError as exc:
        report.error(f"storage: {exc}")
    return report


class NoRunError(Exception):
    """Nothing hsx wrote is at the URI: no run, and no runs under it."""


def _spec(output_uri: str, output: OutputSpec | None) -> OutputSpec:
    if output:
        return output.model_copy(update={"uri": output_uri})
    return OutputSpec.model_validate({"uri": output_uri})


def _holds_a_run(uri: str, output: OutputSpec | None) -> bool:
    try:
        output_uri, run_id = split_run_uri(uri)
    except InvalidKeyError:
        return False
    store = open_store(_spec(output_uri, output), run_id)
    base = store.layout.root + "/"
    run_level = {PLAN_NAME, MANIFEST_NAME, "commits", "shards"}  # what a run writes at its root
    try:
        return any(key[len(base) :].split("/", 1)[0] in run_level for key in store.backend.list_keys(base))
    finally:
        store.close()


def find_runs(root: str, output: OutputSpec | None = None) -> list[str]:
    """The runs directly under an output root (``{root}/{runId}`` holding a plan or manifest)."""
    root = root.rstrip("/")
    backend, prefix = open_backend(root, _spec(root, output))
    base = f"{prefix}/" if prefix else ""
    runs = set()
    for key in backend.list_keys(base):
        run_id, _, name = key[len(base) :].partition("/")
        if name in (PLAN_NAME, MANIFEST_NAME):
            runs.add(run_id)
    return [f"{root}/{run_id}" for run_id in sorted(runs)]


def verify_uri(
    uri: str, sample_fraction: float | None = None, output: OutputSpec | None = None
) -> list[VerifyReport]:
    """Verify the run at ``uri``, or every run under ``uri`` when it is an output root.

    Raises NoRunError when neither is there (a missing path is an error, never an empty OK)."""
    try:
        check_uri(uri)  # the URI as given: its parent ("s3:" of "s3:/x") would hide the mistake
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if _holds_a_run(uri, output):
        return [run_verify(uri, sample_fraction, output)]
    runs = find_runs(uri, output)
    if not runs:
        raise NoRunError(
            f"{uri}: no hsx run there (no plan.json, commit record or manifest.json) and no runs under it"
        )
    return [run_verify(run, sample_fraction, output) for run in runs]


def _verify(store: Store, report: VerifyReport, fraction: float | None, rng: random.Random) -> None:
    committed = sorted(store.committed_shards())
    report.shards_committed = len(committed)
    commits: list[ShardCommit] = []
    seen: Counter[int] = Counter()
    for k in committed:
        try:
            commit = store.get_commit(k)
        except PermanentStoreError as exc:  # a damaged record: say so, check the others
            report.error(f"shard {k}: {exc}")
            continue
        if commit is None:
            report.error(f"shard {k}: commit record vanished while verifying")
            continue
        commits.append(commit)
        seen.update(commit.sample_indices)
        seen.update(q.index for q in commit.quarantine)
        report.samples += commit.samples
        report.quarantined += commit.quarantined
        report.bytes_stored += commit.bytes_stored
        report.bytes_raw += commit.bytes_raw
        _verify_shard(store, commit, report, fraction, rng)
    report.duplicates = sum(n - 1 for n in seen.values() if n > 1)
    if report.duplicates:
        dup = sorted(i for i, n in seen.items() if n > 1)
        report.error(f"{report.duplicates} duplicate sample indices across shards, e.g. {dup[:10]}")
    _verify_plan_and_manifest(store, commits, report)
    orphans = store.unreferenced_shard_objects(commits)
    if orphans:
        # Harmless (readers trust only commit records) but worth knowing: finalize deletes them.
        report.warnings.append(f"{len(orphans)} shard objects have no commit record, e.g. {orphans[:3]}")


def _verify_shard(
    store: Store, commit: ShardCommit, report: VerifyReport, fraction: float | None, rng: random.Random
) -> None:
    k = commit.shard_index
    expected_key = store.layout.shard_key(k, commit.checksum)
    if commit.key != expected_key:
        report.error(f"shard {k}: commit record names key {commit.key!r}, expected {expected_key!r}")
        return
    size = store.backend.size(commit.key)
    if size != commit.bytes_stored:
        report.error(f"shard {k}: object size {size}, commit record says {commit.bytes_stored}")
        return
    try:
        header = store.read_header(commit.key)
    except ShardFormatError as exc:
        report.error(f"shard {k}: {exc}")
        return
    if header.header_checksum != commit.checksum:
        report.error(
            f"shard {k}: shard checksum {header.header_checksum}, commit record says {commit.checksum}"
        )
    if header.shard_index != k:
        report.error(f"shard {k}: the object's header is for shard {header.shard_index}")
    if tuple(s.index for s in header.samples) != commit.sample_indices:
        report.error(f"shard {k}: header and commit record list different samples")
    # Sized by the record, never by its claimed range (a stop of 1e9 must not build a 1e9 set).
    covered = set(commit.sample_indices) | {q.index for q in commit.quarantine}
    in_range = all(commit.start <= i < commit.stop for i in covered)
    if not in_range or len(covered) != commit.stop - commit.start:
        report.error(f"shard {k}: samples + quarantined do not cover [{commit.start}, {commit.stop}) exactly")
    if header.object_size != size:
        # Sample reads would reach past the object (or leave bytes unchecked): read none.
        report.error(f"shard {k}: samples do not tile the object ({header.object_size} != {size} bytes)")
        return
    if fraction is None:
        counts = _check_stream(store, commit.key, header, report)
        if commit.token_counts is not None and counts != commit.token_counts:
            report.error(f"shard {k}: token counts in the commit record disagree with its samples")
    else:
        count = (
            min(len(header.samples), max(1, round(fraction * len(header.samples)))) if header.samples else 0
        )
        for entry in rng.sample(list(header.samples), count):
            try:
                store.read_sample(commit.key, header, entry, verify=True)
                report.samples_checked += 1
            except ShardFormatError as exc:
                report.error(f"shard {k}: {exc}")


def _check_stream(store: Store, key: str, header: ShardHeader, report: VerifyReport) -> dict[int, int]:
    """Read the object front to back once; check and decode each sample as it completes. Returns
    the loss-masked token counts of the samples read."""
    counts: dict[int, int] = {}
    buffer = bytearray()
    position = 0  # object offset of buffer[0]
    pending = list(header.samples)
    for chunk in store.backend.iter_object(key, STREAM_CHUNK):
        buffer += chunk
        while pending and position + len(buffer) >= header.data_start + pending[0].offset + pending[0].length:
            entry = pending.pop(0)
            start = header.data_start + entry.offset - position
            blob = bytes(buffer[start : start + entry.length])
            try:
                if checksum(blob) != entry.checksum:
                    raise ShardFormatError(f"sample {entry.index} ({entry.sample_id}): checksum mismatch")
                rec = decode_sample(blob, entry, verify=False, kernels=native.kernels())
                add_counts(counts, count_masked(rec.input_ids, rec.loss_mask))
                report.samples_checked += 1
            except ShardFormatError as exc:
                report.error(f"{key}: {exc}")
            del buffer[: start + entry.length]
            position += start + entry.length
    if pending:
        report.error(f"{key}: object ended before sample {pending[0].index}")
    return counts


def _verify_plan_and_manifest(store: Store, commits: list[ShardCommit], report: VerifyReport) -> None:
    plan = store.get_json(PLAN_NAME)
    manifest = store.get_json(MANIFEST_NAME)
    by_index = {c.shard_index: c for c in commits}
    if plan is None:
        report.warnings.append("no plan.json: cannot tell whether every shard is committed")
    else:
        try:
            planned = planned_shards(plan)
        except PlanMismatch as exc:
            report.error(f"{PLAN_NAME}: {exc}")
            return
        report.shards_planned = len(planned)
        missing = [k for k, _, _ in planned if k not in by_index]
        if missing and manifest is not None:
            report.error(
                f"manifest exists but {len(missing)} planned shards have no commit record, e.g. {missing[:10]}"
            )
        elif missing:
            report.warnings.append(
                f"run incomplete: {len(missing)} planned shards not committed yet, e.g. {missing[:10]}"
            )
        for k, start, stop in planned:
            c = by_index.get(k)
            if c is not None and (c.start, c.stop) != (start, stop):
                report.error(f"shard {k}: committed for [{c.start}, {c.stop}), planned [{start}, {stop})")
        extra = sorted(set(by_index) - {k for k, _, _ in planned})
        if extra:
            report.error(f"{len(extra)} committed shards are not in plan.json, e.g. {extra[:10]}")
    if manifest is None:
        return
    report.manifest = True
    compression = manifest.get("compression")
    expected = build_manifest(
        store.layout.run_id,
        str(compression.get("setting") if isinstance(compression, dict) else None),
        commits,
        {name: manifest[name] for name in DESCRIBED if name in manifest},
    )
    # Manifests before quarantineByReason listed every quarantined row: their first rows are what is listed now.
    listed = manifest.get("quarantine")
    stored = {**manifest, "quarantine": listed[:QUARANTINE_LISTED] if isinstance(listed, list) else listed}
    fields = ["samples", "quarantined", "shards", "quarantine", "compression", "tokenCounts"]
    if "quarantineByReason" in manifest:
        fields.append("quarantineByReason")
    for field_name in fields:
        if stored.get(field_name) != expected[field_name]:
            report.error(f"manifest field {field_name!r} disagrees with the commit records")
