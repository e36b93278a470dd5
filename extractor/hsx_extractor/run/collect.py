"""Collect the dump of one rid from the dump directory.

Correlation is by rid only: the collector looks at ``protocol.dump_path(dir, rid)`` and
``protocol.error_path(dir, rid)`` for exactly the rid it sent, never at arrival order or the
newest file. Works on any plain directory of dumps (the SGLang hook's tests use it so).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsx_extractor import protocol
from hsx_extractor.protocol import Dump, ProtocolError
from hsx_extractor.reasons import Reason
from hsx_extractor.run.validate import Mismatch, check_dump


@dataclass(frozen=True)
class Found:
    """The complete dump of a rid."""

    dump: Dump
    path: Path


@dataclass(frozen=True)
class ServerRefused:
    """The server wrote an error marker instead of data for the rid."""

    reason: str
    message: str
    path: Path


Arrival = Found | ServerRefused


def look(dump_dir: str | os.PathLike[str], rid: str) -> Arrival | Mismatch | None:
    """What the directory holds for ``rid`` right now (None: nothing yet). Reads the file if so."""
    err = protocol.error_path(dump_dir, rid)
    if err.exists():
        try:
            marker = protocol.read_error(err)
        except (ValueError, ProtocolError) as exc:
            return ServerRefused("unreadable_marker", str(exc), err)
        return ServerRefused(marker.get("reason", "unknown"), marker.get("message", ""), err)
    path = protocol.dump_path(dump_dir, rid)
    try:
        dump = protocol.read_dump(path)
    except FileNotFoundError:
        return None
    except ProtocolError as exc:
        # Renamed into place only when complete, so a damaged file is a server bug, not a race.
        return Mismatch(Reason.LENGTH_MISMATCH, f"damaged dump: {exc}")
    return Found(dump, path)


def check_collected(
    arrival: Arrival | Mismatch,
    rid: str,
    sent_ids: np.ndarray,
    hidden_size: int,
    num_aux: int,
    capture_layers: tuple[int, ...] | None = None,
    producer: str | None = None,
    final_state: str | None = None,
    scan_values: bool = True,
) -> Dump | Mismatch:
    """The dump if it is exactly the sample sent as ``rid``, else why not (``scan_values``: see
    :func:`~hsx_extractor.run.validate.check_dump`)."""
    if isinstance(arrival, Mismatch):
        return arrival
    if isinstance(arrival, ServerRefused):
        return Mismatch(Reason.SERVER_ERROR, f"server: {arrival.reason}: {arrival.message}")
    mismatch = check_dump(
        rid, sent_ids, arrival.dump, hidden_size, num_aux, capture_layers, producer, final_state, scan_values
    )
    return mismatch or arrival.dump


def remove(dump_dir: str | os.PathLike[str], rid: str) -> None:
    """Delete whatever the directory holds for ``rid``."""
    protocol.dump_path(dump_dir, rid).unlink(missing_ok=True)
    protocol.error_path(dump_dir, rid).unlink(missing_ok=True)


# A writer fills its partial file in one go (seconds at most); one untouched this long belongs to a
# server that died mid-write and will never be renamed or removed by it.
STALE_PARTIAL_SECONDS = 60.0


def _is_stale_partial(name: str, mtime: float, now: float, stale_after: float) -> bool:
    return name.endswith(protocol.PARTIAL_SUFFIX) and now - mtime > stale_after


def waiting_bytes(
    dump_dir: str | os.PathLike[str],
    exclude_rids: Container[str] = (),
    stale_after: float = STALE_PARTIAL_SECONDS,
    own: protocol.RunKey | None = None,
) -> int:
    """Bytes of the files in the dump directory, except those of ``exclude_rids`` (the caller
    counts them itself) and stale partials (a dead writer's; they would block back-pressure forever).
    Live partials count: they hold shm too. With ``own``, only the files of rids sent by ``own``'s
    slot (run, replica and worker) count (any process of it: a dead one's are swept): another run's files, or
    names outside the protocol, are not ours to wait for - nobody here would ever remove them."""
    total = 0
    now = time.time()
    try:
        with os.scandir(dump_dir) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if _is_stale_partial(entry.name, st.st_mtime, now, stale_after):
                    continue
                rid = protocol.rid_of(entry.name) or protocol.rid_of_partial(entry.name)
                if rid is not None and rid in exclude_rids:
                    continue
                if own is not None:
                    owner = protocol.owner_of(rid) if rid is not None else None
                    if owner is None or not owner.same_slot(own):
                        continue
                total += st.st_size
    except FileNotFoundError:
        return 0
    return total


# A live extractor takes (or, abandoning it, deletes) a dump within seconds of its arrival; a
# complete dump of another run untouched this long belongs to a run that is gone.
ORPHAN_DUMP_SECONDS = 3600.0


def remove_orphans(
    dump_dir: str | os.PathLike[str], own: protocol.RunKey, older_than: float = ORPHAN_DUMP_SECONDS
) -> int:
    """Delete complete dumps/markers of other runs' rids older than ``older_than`` seconds: their
    extractor is dead and nobody else would free their shm. Names outside the protocol are left."""
    removed = 0
    now = time.time()
    with os.scandir(dump_dir) as entries:
        for entry in entries:
            rid = protocol.rid_of(entry.name)
            owner = protocol.owner_of(rid) if rid is not None else None
            if owner is None or owner.same_slot(own):
                continue
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            if now - mtime > older_than:
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
    return removed


def remove_stale_partials(
    dump_dir: str | os.PathLike[str], stale_after: float = STALE_PARTIAL_SECONDS
) -> int:
    """Delete partial files no writer has touched for ``stale_after`` seconds; frees their shm."""
    removed = 0
    now = time.time()
    with os.scandir(dump_dir) as entries:
        for entry in entries:
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            if _is_stale_partial(entry.name, mtime, now, stale_after):
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
    return removed


def remove_dead_processes(dump_dir: str | os.PathLike[str], own: protocol.RunKey) -> int:
    """Delete complete dumps/markers sent by another process of ``own``'s slot (run, replica, worker):
    one slot has one live extractor, so they are a dead earlier process's leftovers. Matched on the
    parsed (run, replica, process) of each rid, never on a name prefix: runId ``job`` replica 1
    must not touch the dumps of runId ``job-r1``."""
    removed = 0
    for entry in os.scandir(dump_dir):
        rid = protocol.rid_of(entry.name)
        owner = protocol.owner_of(rid) if rid is not None else None
        if owner is not None and owner.same_slot(own) and owner.process != own.process:
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    return removed


class Collector:
    """Waits for the dumps of rids the extractor sent, in a thread so reads never block the loop."""

    def __init__(
        self,
        dump_dir: str | os.PathLike[str],
        poll_min: float = 0.002,
        poll_max: float = 0.05,
        own: protocol.RunKey | None = None,
        stale_partial_seconds: float = STALE_PARTIAL_SECONDS,
        orphan_seconds: float = ORPHAN_DUMP_SECONDS,
    ) -> None:
        self.dump_dir = Path(dump_dir)
        self.stale_partial_seconds = stale_partial_seconds
        self.orphan_seconds = orphan_seconds
        self.poll_min = poll_min
        self.poll_max = poll_max
        # Rids given up on: a late dump for them is deleted when it appears, never used.
        self._abandoned: set[str] = set()
        # This process's key: dumps of another process of its run and replica are a dead earlier
        # process's (the server may still finish its last requests after a restart).
        self.own = own

    async def wait(self, rid: str, timeout: float) -> Arrival | Mismatch | None:
        """The rid's dump or error marker, or None if neither appeared within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        delay = self.poll_min
        while True:
            found = await asyncio.to_thread(look, self.dump_dir, rid)
            if found is not None:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, self.poll_max)

    def abandon(self, rid: str) -> None:
        self._abandoned.add(rid)
        remove(self.dump_dir, rid)

    def sweep(self) -> int:
        """Delete late arrivals of abandoned rids, dumps of dead processes of this replica, orphans of
        dead runs and partials of dead writers; returns how many files went."""
        gone = remove_stale_partials(self.dump_dir, self.stale_partial_seconds)
        if self.own is not None:
            gone += remove_dead_processes(self.dump_dir, self.own)
            gone += remove_orphans(self.dump_dir, self.own, self.orphan_seconds)
        for rid in list(self._abandoned):
            for path in (protocol.dump_path(self.dump_dir, rid), protocol.error_path(self.dump_dir, rid)):
                if path.exists():
                    path.unlink(missing_ok=True)
                    gone += 1
        return gone
