"""The shard plan: which dataset positions go into which shard. The one place that decides it.

Shard k holds a fixed, contiguous range of row indices, cut so each shard holds about
``shardTargetBytes`` of raw hidden states. The plan is stored once (plan.json, write-if-absent),
so restarts and replicas all use the same ranges and a rerun produces the same shard keys.

The plan also records what it was made from, so a resume cannot mix two datasets: the dataset's
size and ETag (or mtime) and, per shard, the file lines its samples come from and a digest of
those rows' raw bytes. When the dataset's stat differs at resume, the rows are hashed again and
every shard whose rows changed is named.
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import xxhash

from hsx_extractor.run.sources import OversizedRow

PLAN_NAME = "plan.json"
PLAN_VERSION = 1


class PlanMismatch(ValueError):
    """A stored plan was made with other settings than this run's."""


def bytes_per_sample(length: int, num_aux: int, hidden_size: int) -> int:
    """Raw bytes a sample of ``length`` tokens takes: bf16 aux + final states, int32 ids, uint8 mask."""
    return length * ((num_aux + 1) * hidden_size * 2 + 4 + 1)


class ShardCutter:
    """The cut rule, a row at a time: a shard closes once it reaches the target bytes. Shards are
    contiguous, so a row's shard is known when it is read and a shard's end when its last row is."""

    def __init__(self, target_bytes: int) -> None:
        self.target_bytes = target_bytes
        self.shard = 0  # the shard the next row goes into
        self.start = 0  # its first row
        self.rows = 0  # rows seen
        self._size = 0

    def add(self, nbytes: int) -> bool:
        """Put the next row (``nbytes`` raw) in the open shard; True when that closes the shard."""
        self.rows += 1
        self._size += nbytes
        if self._size < self.target_bytes:
            return False
        self.shard, self.start, self._size = self.shard + 1, self.rows, 0
        return True


def identity_digest(identity: dict[str, Any]) -> str:
    """xxh3-64 (hex) of a plan's settings (ShardPlan.identity), as canonical JSON."""
    return xxhash.xxh3_64_hexdigest(json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str).encode())


def cut_shards(sample_bytes: Sequence[int], target_bytes: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges covering every row; a shard closes once it reaches the target.

    Rejected rows weigh 0 bytes but still belong to a shard (their quarantine entry lives there).
    """
    cutter = ShardCutter(target_bytes)
    shards: list[tuple[int, int]] = []
    for nbytes in sample_bytes:
        start = cutter.start
        if cutter.add(nbytes):
            shards.append((start, cutter.rows))
    if cutter.start < cutter.rows:
        shards.append((cutter.start, cutter.rows))
    return shards


@dataclass(frozen=True)
class ShardPlan:
    """What plan.json holds."""

    # Settings the plan depends on; a restart with different ones must not reuse it.
    identity: dict[str, Any]
    rows: int
    shards: list[tuple[int, int]]
    # Rows rejected as duplicate ids (first accepted occurrence wins); needs the whole dataset to know.
    duplicates: frozenset[int] = field(default_factory=frozenset)
    # Per shard, the first and last file line its samples come from, and the digest of those
    # rows' raw bytes (shard_digests); empty in plans made without them.
    lines: tuple[tuple[int, int], ...] = ()
    digests: tuple[str, ...] = ()
    # The dataset's stat when planned (storage.uris.uri_stat): size and ETag or mtime.
    source: dict[str, Any] = field(default_factory=dict)

    def shard_range(self, shard: int) -> range:
        start, end = self.shards[shard]
        return range(start, end)

    def cut(self, shard: int) -> ShardCut:
        """Shard ``shard`` as the planner cut it."""
        start, stop = self.shards[shard]
        if not self.digests:
            return ShardCut(shard, start, stop)
        return ShardCut(shard, start, stop, self.lines[shard], self.digests[shard], self.identity_digest)

    @functools.cached_property
    def identity_digest(self) -> str:
        return identity_digest(self.identity)

    def planned(self) -> list[tuple[int, int, int]]:
        """``(shard index, start, stop)`` of every shard, as the store's finalize takes them."""
        return [(k, a, b) for k, (a, b) in enumerate(self.shards)]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "identity": self.identity,
            "rows": self.rows,
            "shards": [
                {
                    "index": k,
                    "start": a,
                    "stop": b,
                    **({"lines": list(self.lines[k]), "digest": self.digests[k]} if self.digests else {}),
                }
                for k, (a, b) in enumerate(self.shards)
            ],
            "duplicates": sorted(self.duplicates),
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardPlan:
        if data.get("version") != PLAN_VERSION:
            raise PlanMismatch(f"plan.json version {data.get('version')!r}, expected {PLAN_VERSION}")
        shards = sorted(data["shards"], key=lambda s: s["index"])
        known = all("digest" in s and "lines" in s for s in shards)
        digests = tuple(str(s["digest"]) for s in shards) if known else ()
        lines = tuple((int(s["lines"][0]), int(s["lines"][1])) for s in shards) if known else ()
        return cls(
            identity=dict(data["identity"]),
            rows=int(data["rows"]),
            shards=[(int(s["start"]), int(s["stop"])) for s in shards],
            duplicates=frozenset(int(i) for i in data.get("duplicates", [])),
            lines=lines,
            digests=digests,
            source=dict(data.get("source") or {}),
        )

    @property
    def rows_digest(self) -> str:
        """One digest of every planned shard's rows (their lines' raw bytes, as the readers check them):
        what a run's samples were cut from, whatever the file holds later ("" for plans without them)."""
        if not self.digests:
            return ""
        return xxhash.xxh3_64_hexdigest("\n".join([str(self.rows), *self.digests]).encode())

    @property
    def last_line(self) -> int:
        return max((last for _, last in self.lines), default=0)

    def changed_shards(self, line_digests: Mapping[int, int]) -> list[str]:
        """What differs between the planned rows and the dataset's now, by line (empty: nothing)."""
        changes = []
        seen = max(line_digests, default=0)
        if seen < self.last_line:
            changes.append(f"the dataset now ends at line {seen}, the plan reaches line {self.last_line}")
        now = shard_digests(self.lines, line_digests)
        for k, ((start, stop), (first, last), planned, current) in enumerate(
            zip(self.shards, self.lines, self.digests, now, strict=True)
        ):
            if planned != current:
                changes.append(f"shard {k} (samples {start}-{stop - 1}, lines {first}-{last}) changed")
        return changes

    def check_identity(self, identity: dict[str, Any]) -> None:
        diffs = [
            f"{key}: stored {self.identity.get(key)!r}, now {identity.get(key)!r}"
            for key in sorted(set(identity) | set(self.identity))
            if self.identity.get(key) != identity.get(key)
        ]
        if diffs:
            raise PlanMismatch(
                "this run's output was planned with other settings (" + "; ".join(diffs) + "); "
                "use a new runId or the original settings"
            )


class Row(Protocol):
    """A dataset row as read: its file line and its raw bytes (or a decoded Parquet row)."""

    @property
    def line(self) -> int: ...

    @property
    def data(self) -> bytes | dict[str, Any] | OversizedRow: ...


R = TypeVar("R", bound=Row)


def row_digest(data: bytes | dict[str, Any] | OversizedRow) -> int:
    """The digest of one dataset row: its raw bytes, or a Parquet row's canonical JSON (a line read
    past for its size carries the digest of its bytes)."""
    if isinstance(data, OversizedRow):
        return data.digest
    if not isinstance(data, bytes | bytearray):
        data = json.dumps(data, sort_keys=True, default=str).encode()
    return xxhash.xxh3_64_intdigest(data)


def hashed(rows: Iterable[R], digests: dict[int, int]) -> Iterator[R]:
    """``rows`` unchanged, recording each one's row_digest under its line as it is read."""
    for row in rows:
        digests[row.line] = row_digest(row.data)
        yield row


def shard_digests(shard_lines: Sequence[tuple[int, int]], line_digests: Mapping[int, int]) -> list[str]:
    """Per shard, one digest over the digests of the rows on its lines ``[first, last]``, and their count."""
    out = []
    for first, last in shard_lines:
        found = [line_digests[n] for n in range(first, last + 1) if n in line_digests]
        h = xxhash.xxh3_64()
        h.update(array("Q", found).tobytes())
        h.update(array("Q", [len(found)]).tobytes())
        out.append(h.hexdigest())
    return out


class DatasetChanged(ValueError):
    """The rows the extraction read for a shard are not the rows the plan was made from."""


class RowWitness:
    """Checks, as the extraction reads the dataset, that each planned shard's rows hash to the digest
    the plan recorded for them (the planning pass read the file separately, maybe long before): an
    edit under a running or resumed run stops it with :class:`DatasetChanged` instead of pairing a
    plan's shard with other rows. A shard is checked once the row on its last line is read; line
    digests are kept only until the shard holding them is checked."""

    def __init__(self) -> None:
        self._digests: dict[int, int] = {}  # line -> row digest, lines not yet checked
        self._pending: list[ShardCut] = []  # cuts with digests, by last line
        self._seen_line = -1

    def expect(self, cut: ShardCut) -> None:
        if cut.lines is None or cut.digest is None:
            return
        self._pending.append(cut)
        self._pending.sort(key=lambda c: c.lines[1] if c.lines else 0)
        self._check_ready()

    def rows(self, rows: Iterable[R]) -> Iterator[R]:
        """``rows`` unchanged, each one's digest recorded as it is read."""
        for row in rows:
            self._digests[row.line] = row_digest(row.data)
            self._seen_line = row.line
            self._check_ready()
            yield row

    def _check_ready(self) -> None:
        while self._pending and self._pending[0].lines is not None and self._pending[0].lines[1] <= self._seen_line:
            cut = self._pending.pop(0)
            assert cut.lines is not None
            first, last = cut.lines
            (now,) = shard_digests([cut.lines], self._digests)
            if now != cut.digest:
                raise DatasetChanged(
                    f"shard {cut.shard} (samples {cut.start}-{cut.stop - 1}, lines {first}-{last}) is not what the "
                    "plan was made from: the dataset changed under the run. Restore it, or start a new runId"
                )
            # The last line stays: with expandTurns one row's samples can open the next shard too.
            for line in [n for n in self._digests if n < last]:
                del self._digests[line]


@dataclass(frozen=True)
class ShardCut:
    """One shard of the plan, known once its last row is read: its rows, and (when line digests are
    kept) the file lines they come from and the digest of those rows' raw bytes."""

    shard: int
    start: int
    stop: int
    lines: tuple[int, int] | None = None
    digest: str | None = None
    # identity_digest of the settings the plan was made with.
    plan: str | None = None

    def source_json(self) -> dict[str, Any] | None:
        """What a commit record keeps of it, so a run whose plan.json was never written can tell a
        committed shard's rows, and the settings it was made with, from changed ones."""
        if self.lines is None or self.digest is None:
            return None
        return {"lines": list(self.lines), "digest": self.digest, **({"plan": self.plan} if self.plan else {})}


@dataclass(frozen=True)
class Placed:
    """Where the planner put a row: its shard, whether its id repeats an earlier accepted row's
    (it is then rejected as a duplicate), and the cut its shard got if this row closed it."""

    shard: int
    duplicate: bool
    cut: ShardCut | None


class Planner:
    """Makes the plan a row at a time, in dataset order, so extraction can start on a shard as soon as
    its rows are read instead of after a pass over the whole dataset. ``finish`` gives the plan
    :func:`build_plan` makes from the same rows."""

    def __init__(
        self,
        identity: dict[str, Any],
        num_aux: int,
        hidden_size: int,
        target_bytes: int,
        line_digests: Mapping[int, int] | None = None,
    ) -> None:
        self.identity = identity
        self._identity_digest = identity_digest(identity)
        self.num_aux = num_aux
        self.hidden_size = hidden_size
        self.line_digests = line_digests
        self._cutter = ShardCutter(target_bytes)
        self._seen: set[str] = set()
        self._duplicates: set[int] = set()
        self._cuts: list[ShardCut] = []
        self._first_line: int | None = None  # of the open shard

    @property
    def rows(self) -> int:
        return self._cutter.rows

    def add(self, length: int | None, sample_id: str | None, line: int = 0) -> Placed:
        """The next row: its token count and id (None when rejected) and its file line."""
        index = self._cutter.rows
        shard, start = self._cutter.shard, self._cutter.start
        if self._first_line is None:
            self._first_line = line
        duplicate = False
        nbytes = 0
        if length is not None and sample_id is not None:
            if sample_id in self._seen:
                duplicate = True
                self._duplicates.add(index)
            else:
                self._seen.add(sample_id)
                nbytes = bytes_per_sample(length, self.num_aux, self.hidden_size)
        cut = self._close(shard, start, self._cutter.rows, line) if self._cutter.add(nbytes) else None
        return Placed(shard, duplicate, cut)

    def _close(self, shard: int, start: int, stop: int, last_line: int) -> ShardCut:
        lines = digest = None
        if self.line_digests is not None and self._first_line is not None:
            lines = (self._first_line, last_line)
            digest = shard_digests([lines], self.line_digests)[0]
        self._first_line = None
        cut = ShardCut(shard, start, stop, lines, digest, self._identity_digest)
        self._cuts.append(cut)
        return cut

    def finish(self, last_line: int = 0, source: dict[str, Any] | None = None) -> tuple[ShardCut | None, ShardPlan]:
        """After the last row: the cut of the shard still open (None if the last row closed one) and
        the whole plan."""
        last = None
        if self._cutter.start < self._cutter.rows:
            last = self._close(self._cutter.shard, self._cutter.start, self._cutter.rows, last_line)
        cuts = self._cuts
        with_lines = all(c.lines is not None for c in cuts) and self.line_digests is not None
        plan = ShardPlan(
            self.identity,
            self.rows,
            [(c.start, c.stop) for c in cuts],
            frozenset(self._duplicates),
            tuple(c.lines for c in cuts if c.lines is not None) if with_lines else (),
            tuple(c.digest for c in cuts if c.digest is not None) if with_lines else (),
            dict(source or {}),
        )
        return last, plan


def build_plan(
    identity: dict[str, Any],
    lengths: Iterable[int | None],
    ids: Iterable[str | None],
    num_aux: int,
    hidden_size: int,
    target_bytes: int,
    sample_lines: Sequence[int] = (),
    line_digests: Mapping[int, int] | None = None,
    source: dict[str, Any] | None = None,
) -> ShardPlan:
    """The plan from the pre-pass: per sample its token count and id (None when rejected), its file
    line and each line's row digest. Pure."""
    kept = line_digests if sample_lines and line_digests is not None else None
    planner = Planner(identity, num_aux, hidden_size, target_bytes, kept)
    line = 0
    for index, (length, sample_id) in enumerate(zip(lengths, ids, strict=True)):
        line = sample_lines[index] if kept is not None else 0
        planner.add(length, sample_id, line)
    return planner.finish(line, source)[1]


def planned_shards(data: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(shard index, start, stop)`` from a stored plan.json, checked only as far as verify needs."""
    try:
        shards = [(int(s["index"]), int(s["start"]), int(s["stop"])) for s in data["shards"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanMismatch(f"plan.json needs shards: [{{index, start, stop}}, ...]: {exc}") from exc
    if len({k for k, _, _ in shards}) != len(shards):
        raise PlanMismatch("plan.json lists a shard twice")
    return sorted(shards)
