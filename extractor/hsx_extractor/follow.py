"""Reading a run while it grows: ``HiddenStatesDataset(uri, follow=True)`` is a torch
``IterableDataset`` that yields each committed shard's samples as the shard lands and ends when the
run's manifest is written, so training can start hours before extraction ends and still read the
durable, resumable, verified copy.

Why it can neither miss nor repeat a sample: a commit record is written once and never changes
(the exactly-once commit, docs/format.md), so a shard seen committed is final; the follower yields
each shard once, by index. It reads the manifest *before* listing the commit records, and a manifest
is written only after every commit, so the listing that follows a manifest holds every shard; the
shards it yielded must then be exactly the manifest's, checksum for checksum, or it raises.

Items and checks are the map-style reader's (``reader.to_specforge``; each shard's record and header
checked before its first sample, each sample checksummed). In DataLoader workers, and across
training ranks (``rank``/``world_size``), shard ``k`` belongs to slot ``k % slots``: every sample is
read by exactly one worker of one rank. Order: shards as they are discovered, lowest index first
among those found in one poll; samples in shard order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.layout import MANIFEST_NAME, split_run_uri
from hsx_extractor.storage.manifest import Capture, ManifestError
from hsx_extractor.storage.store import Store, open_store

if TYPE_CHECKING:
    import torch

try:
    from torch.utils.data import IterableDataset as _IterableBase
except ImportError:  # pragma: no cover - the extractor image
    _IterableBase = object  # type: ignore[assignment,misc]


class RunStalled(TimeoutError):
    """No shard was committed and no manifest written for ``idle_timeout_seconds``: the run is
    stopped, failed or suspended (its ExtractionJob's status says which)."""


class FollowedRun(_IterableBase):  # type: ignore[misc,valid-type]
    """Samples of the run at ``uri`` as its shards are committed; ends with the run's manifest.

    ``poll_seconds``: how often the commit records are listed (one LIST per poll per worker).
    ``idle_timeout_seconds``: raise :class:`RunStalled` after this long without a new shard
    (``None``: wait for ever). ``rank``/``world_size``: this trainer process's share of the shards.
    """

    def __init__(
        self,
        uri: str,
        output: OutputSpec | None = None,
        verify_checksums: bool = True,
        capture: Capture | None = None,
        poll_seconds: float = 10.0,
        idle_timeout_seconds: float | None = 3600.0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if poll_seconds <= 0:
            raise ValueError(f"poll_seconds must be positive, not {poll_seconds}")
        self.uri = uri
        output_uri, self.run_id = split_run_uri(uri)
        self._spec = output.model_copy(update={"uri": output_uri}) if output else OutputSpec.model_validate(
            {"uri": output_uri}
        )
        self.verify_checksums = verify_checksums
        self.capture = capture
        self.poll_seconds = poll_seconds
        self.idle_timeout_seconds = idle_timeout_seconds
        self.rank, self.world_size = rank, world_size

    def slot(self) -> tuple[int, int]:
        """``(slot, slots)``: this process's (and DataLoader worker's) share of the shard indices."""
        try:
            from torch.utils.data import get_worker_info
        except ImportError:  # pragma: no cover - the extractor image
            info = None
        else:
            info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from hsx_extractor.reader import SharedBuffers, to_specforge

        try:
            from torch.utils.data import get_worker_info
        except ImportError:  # pragma: no cover - the extractor image
            in_worker = False
        else:
            in_worker = get_worker_info() is not None
        for store, commit, header, entry in self.entries():
            if in_worker:  # decoded into shared memory, as the map-style dataset does
                shared = SharedBuffers()
                rec = store.read_sample(commit.key, header, entry, self.verify_checksums, shared.allocate)
                yield to_specforge(rec, shared.tensors)
            else:
                yield to_specforge(store.read_sample(commit.key, header, entry, self.verify_checksums))

    def entries(self) -> Iterator[tuple[Store, Any, Any, Any]]:
        """``(store, commit, header, sample entry)`` of every sample of this slot's shards, once each,
        as they are committed (no torch needed)."""
        from hsx_extractor.reader import capture_of

        store = open_store(self._spec, self.run_id, writing=False)
        slot, slots = self.slot()
        seen: dict[int, str] = {}  # shard index -> checksum of the commit yielded
        last_new = time.monotonic()
        while True:
            manifest = store.get_json(MANIFEST_NAME)  # before the listing: see the module's docstring
            if manifest is not None:
                capture_of(self.uri, manifest, self.capture)  # refuses a manifest that contradicts the caller
            fresh = sorted(k for k in store.committed_shards() if k % slots == slot and k not in seen)
            for k in fresh:
                commit = store.get_commit(k)
                if commit is None:  # listed but unreadable now: next poll
                    continue
                header = store.checked_header(commit)
                by_index = {entry.index: entry for entry in header.samples}
                for index in commit.sample_indices:
                    yield store, commit, header, by_index[index]
                seen[k] = commit.checksum
                last_new = time.monotonic()
            if manifest is not None:
                self._check_complete(manifest, seen, slot, slots)
                return
            if self.idle_timeout_seconds is not None and time.monotonic() - last_new > self.idle_timeout_seconds:
                raise RunStalled(
                    f"{self.uri}: no shard committed and no manifest for {self.idle_timeout_seconds:.0f}s "
                    f"({len(seen)} shards read so far); the run is stopped, failed or suspended"
                )
            time.sleep(self.poll_seconds)

    def _check_complete(self, manifest: dict[str, Any], seen: dict[int, str], slot: int, slots: int) -> None:
        shards = manifest.get("shards") or []
        listed = {int(s["index"]): s["checksum"] for s in shards if int(s["index"]) % slots == slot}
        if listed != seen:
            missing = sorted(set(listed) - set(seen))
            extra = sorted(set(seen) - set(listed))
            changed = sorted(k for k in set(listed) & set(seen) if listed[k] != seen[k])
            raise ManifestError(
                f"{self.uri}/{MANIFEST_NAME} lists other shards than the commit records read while following: "
                f"not read {missing[:10]}, not in the manifest {extra[:10]}, other checksum {changed[:10]}"
            )
