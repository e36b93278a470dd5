"""The trainer's side: a PyTorch ``Dataset`` over a committed hsx output.

Items use SpecForge's offline-dataset keys and shapes, so an EAGLE-3 drafter trainer can use it
directly::

    input_ids         torch.long      [L]
    loss_mask         torch.long      [L]
    hidden_state      torch.bfloat16  [1, L, H]
    aux_hidden_state  torch.bfloat16  [1, L, K*H]   (K = 3 for EAGLE-3)

Only shards with a commit record are read, and a record is not taken on trust: its key must be
this run's key for the shard, and before a shard's first sample is read its object must have the
recorded size and a header that hashes to the recorded shard checksum and lists the recorded
samples (:meth:`Store.checked_header`). Each item is one ranged read inside the object,
checksummed unless ``verify_checksums=False``.

The reader refuses to guess what the states are: :attr:`OutputReader.capture` (engine, layer ids
and their numbering, final state before or after the final norm, dtype) comes from the manifest,
and a manifest without those facts (``hsx-manifest/1``) is refused unless the caller states them
(``capture=Capture(...)``). torch is imported lazily so the extractor image (no torch) can
import the rest of hsx_extractor.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.backends import PermanentStoreError
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.layout import MANIFEST_NAME
from hsx_extractor.storage.manifest import Capture, ManifestError
from hsx_extractor.storage.shard_format import (
    AUX,
    FINAL,
    Allocate,
    SampleRecord,
    ShardFormatError,
    ShardHeader,
)
from hsx_extractor.storage.store import Store, open_store, run_location

if TYPE_CHECKING:
    import torch

try:  # real torch Datasets when torch is there; plain base classes otherwise
    from torch.utils.data import Dataset as _Base
    from torch.utils.data import IterableDataset as _IterableBase
except ImportError:  # pragma: no cover - the extractor image
    _Base = object  # type: ignore[assignment,misc]
    _IterableBase = object  # type: ignore[assignment,misc]


class OutputReader:
    """Random access to the samples of a committed run, without torch."""

    def __init__(
        self,
        uri: str,
        output: OutputSpec | None = None,
        require_manifest: bool = True,
        capture: Capture | None = None,
    ):
        self.uri = uri
        self._spec, self.run_id = run_location(uri, output)
        store = self._open()
        self.manifest = store.get_json(MANIFEST_NAME)
        if require_manifest and self.manifest is None:
            raise PermanentStoreError(
                f"{uri} has no manifest.json: the run is not finished (pass require_manifest=False to read "
                "the shards committed so far)"
            )
        self._capture = capture_of(uri, self.manifest, capture)
        self._shards: list[int] = []
        self._starts: list[int] = []  # position of each shard's first sample in the flat order
        self._indices: list[tuple[int, ...]] = []
        self._commits: dict[int, ShardCommit] = {}
        total = 0
        for k in sorted(store.committed_shards()):
            commit = store.get_commit(k)
            if commit is None or not commit.sample_indices:
                continue
            store.check_commit_key(commit)
            self._shards.append(k)
            self._starts.append(total)
            self._indices.append(commit.sample_indices)
            # Only what reading checks: token counts, quarantine entries and statistics are the
            # manifest's business, and each DataLoader worker gets a pickled copy of this reader.
            self._commits[k] = dataclasses.replace(
                commit, quarantine=(), token_counts=None, layer_norms=None, consistency=None, source=None
            )
            total += commit.samples
        self._len = total
        self._headers: dict[int, ShardHeader] = {}
        self._lock = threading.Lock()
        self._store_obj = store
        self._pid = os.getpid()

    @property
    def capture(self) -> Capture:
        """How the states were captured (the manifest's ``capture``, or what the caller stated)."""
        if self._capture is None:
            raise ManifestError(
                f"{self.uri} has no manifest yet, so nothing says how its states were captured; "
                "pass capture=Capture(...) to state it"
            )
        return self._capture

    @property
    def final_state(self) -> str:
        """``post-norm`` or ``pre-norm``: whether ``hidden_states`` went through the final norm."""
        return self.capture.final_state

    def _open(self) -> Store:
        return open_store(self._spec, self.run_id, writing=False)

    def _store(self) -> Store:
        # boto3 clients do not survive fork(): each DataLoader worker opens its own.
        pid = os.getpid()
        if getattr(self, "_pid", None) != pid:
            self._store_obj = self._open()
            self._pid = pid
            self._headers = {}
        return self._store_obj

    def __len__(self) -> int:
        return self._len

    def named_json(self, name: str) -> dict[str, Any] | None:
        """A named JSON object of the run (``plan.json``, ``manifest.json``), or None."""
        return self._store().get_json(name)

    def locate(self, position: int) -> tuple[int, int, int]:
        """(shard index, dataset index, slot in the shard) of the ``position``-th sample."""
        if not 0 <= position < self._len:
            raise IndexError(f"sample position {position} out of range [0, {self._len})")
        slot = bisect.bisect_right(self._starts, position) - 1
        within = position - self._starts[slot]
        return self._shards[slot], self._indices[slot][within], within

    def header(self, shard_index: int) -> ShardHeader:
        store = self._store()
        with self._lock:
            cached = self._headers.get(shard_index)
        if cached is None:
            cached = store.checked_header(self._commits[shard_index])
            with self._lock:
                self._headers[shard_index] = cached
        return cached

    def read(self, position: int, verify_checksums: bool = True, allocate: Allocate | None = None) -> SampleRecord:
        """The sample at ``position``; its hidden states decoded into buffers from ``allocate`` if given."""
        shard, index, within = self.locate(position)
        header = self.header(shard)
        entry = header.samples[within] if within < len(header.samples) else None
        if entry is None or entry.index != index:
            raise ShardFormatError(f"shard {shard}: header and commit record disagree at sample {index}")
        return self._store().read_sample(
            self._commits[shard].key, header, entry, verify=verify_checksums, allocate=allocate
        )

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker's copy: no store, no cached headers, and the manifest without its
        # per-shard list, quarantine and token counts (megabytes in a long run, unused by reads).
        state = dict(self.__dict__)
        for name in ("_store_obj", "_pid", "_lock"):
            state.pop(name, None)
        state["_headers"] = {}
        if self.manifest is not None:
            state["manifest"] = {k: v for k, v in self.manifest.items() if k not in ("shards", "quarantine", "tokenCounts")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def capture_of(uri: str, manifest: dict[str, Any] | None, stated: Capture | None) -> Capture | None:
    """The capture facts of a run: the manifest's, which a caller's statement must agree with;
    the caller's where the manifest predates them; None only while there is no manifest."""
    if manifest is None:
        return stated
    if manifest.get("capture") is None and stated is not None:
        return stated
    where = f"{uri}/{MANIFEST_NAME} (format {manifest.get('format')!r})"
    try:
        recorded = Capture.from_json(manifest.get("capture"), where)
    except ManifestError as exc:
        raise ManifestError(
            f"{exc}: it does not say how its states were captured, and the reader will not guess. "
            "Pass capture=Capture(...) stating the engine, layer ids and their convention, and whether "
            "the final state is before or after the final norm"
        ) from None
    if stated is not None and stated != recorded:
        raise ManifestError(f"{where} records {recorded}, the caller stated {stated}")
    return recorded


class HiddenStatesDataset(_Base):  # type: ignore[misc,valid-type]
    """A torch Dataset over a committed run at ``uri`` (``{output.uri}/{runId}``, local or s3://).

    ``output`` supplies endpoint, region and path style for S3 (credentials come from the AWS
    chain). ``require_manifest=False`` also reads runs that are still in progress (the shards
    committed when it is made). ``follow=True`` makes instead a :class:`FollowedRun`: an
    IterableDataset that yields shards as they are committed and ends with the manifest (its
    keyword arguments, e.g. ``poll_seconds``, ``rank``/``world_size``, pass through).
    """

    def __new__(cls, uri: str = "", *args: Any, follow: bool = False, **kwargs: Any) -> Any:
        # uri has a default: unpickling (a DataLoader worker's copy) calls __new__ without arguments.
        if follow:
            if len(args) > 1:  # the map-style positions after ``output`` mean other things there
                raise TypeError("HiddenStatesDataset(uri, output, follow=True) takes its other arguments by keyword")
            return FollowedRun(uri, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        uri: str,
        output: OutputSpec | None = None,
        verify_checksums: bool = True,
        require_manifest: bool = True,
        capture: Capture | None = None,
        follow: bool = False,
    ):
        self.reader = OutputReader(uri, output, require_manifest, capture)
        self.verify_checksums = verify_checksums

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        import torch.utils.data

        if torch.utils.data.get_worker_info() is None:
            return to_specforge(self.reader.read(position, self.verify_checksums))
        # In a DataLoader worker: decode straight into shared memory, which the worker hands to the
        # trainer process as it is (torch copies any other tensor into shared memory first).
        shared = SharedBuffers()
        return to_specforge(self.reader.read(position, self.verify_checksums, shared.allocate), shared.tensors)

    def dataset_index(self, position: int) -> int:
        """The dataset row a position holds (positions skip quarantined rows)."""
        return self.reader.locate(position)[1]


class SharedBuffers:
    """Decode buffers in torch shared memory (one per tensor of a sample), kept by tensor name."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def allocate(self, name: str, num_values: int) -> np.ndarray:
        import torch

        storage = torch.UntypedStorage._new_shared(2 * num_values)  # what torch's own collate uses
        tensor = torch.empty(0, dtype=torch.int16).set_(storage)
        self.tensors[name] = tensor
        return tensor.numpy().view(np.uint16)


def to_specforge(rec: SampleRecord, shared: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A sample as SpecForge's offline dataset stores it (hidden states from ``shared`` when they were
    decoded there)."""
    import torch

    def bf16(name: str, bits: np.ndarray) -> torch.Tensor:
        if shared is not None and name in shared:
            return shared[name].view(torch.bfloat16).reshape(bits.shape).unsqueeze(0)
        # Decoded arrays are the sample's own: viewed, not copied (torch needs them writable).
        own = bits if bits.flags.writeable and bits.flags.c_contiguous else bits.copy()
        return torch.from_numpy(own.view(np.int16)).view(torch.bfloat16).unsqueeze(0)

    return {
        "input_ids": torch.from_numpy(rec.input_ids.astype(np.int64)),
        "loss_mask": torch.from_numpy(rec.loss_mask.astype(np.int64)),
        "hidden_state": bf16(FINAL, rec.hidden_states),
        "aux_hidden_state": bf16(AUX, rec.aux_hidden_states),
    }


# Reading a run while it grows.
# Reading a run while it grows: ``HiddenStatesDataset(uri, follow=True)`` is a torch
# ``IterableDataset`` that yields each committed shard's samples as the shard lands and ends when the
# run's manifest is written, so training can start hours before extraction ends and still read the
# durable, resumable, verified copy.
#
# Why it can neither miss nor repeat a sample: a commit record is written once and never changes
# (the exactly-once commit, docs/format.md), so a shard seen committed is final; the follower yields
# each shard once, by index. It reads the manifest *before* listing the commit records, and a manifest
# is written only after every commit, so the listing that follows a manifest holds every shard; the
# shards it yielded must then be exactly the manifest's, checksum for checksum, or it raises.
#
# Items and checks are the map-style reader's (``reader.to_specforge``; each shard's record and header
# checked before its first sample, each sample checksummed). In DataLoader workers, and across
# training ranks (``rank``/``world_size``), shard ``k`` belongs to slot ``k % slots``: every sample is
# read by exactly one worker of one rank. Order: shards as they are discovered, lowest index first
# among those found in one poll; samples in shard order.


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
        self._spec, self.run_id = run_location(uri, output)
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
