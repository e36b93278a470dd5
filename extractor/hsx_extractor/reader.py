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
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.backends import PermanentStoreError
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.layout import MANIFEST_NAME, split_run_uri
from hsx_extractor.storage.manifest import Capture, ManifestError
from hsx_extractor.storage.shard_format import (
    AUX,
    FINAL,
    Allocate,
    SampleRecord,
    ShardFormatError,
    ShardHeader,
)
from hsx_extractor.storage.store import Store, open_store

if TYPE_CHECKING:
    import torch

try:  # a real torch Dataset when torch is there; a plain base class otherwise
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover - the extractor image
    _Base = object  # type: ignore[assignment,misc]


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
        output_uri, self.run_id = split_run_uri(uri)
        self._spec = (
            output.model_copy(update={"uri": output_uri})
            if output
            else OutputSpec.model_validate({"uri": output_uri})
        )
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
            self._commits[k] = commit
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
        state = dict(self.__dict__)
        for name in ("_store_obj", "_pid", "_lock"):
            state.pop(name, None)
        state["_headers"] = {}
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
    committed when it is made). ``follow=True`` makes instead a ``follow.FollowedRun``: an
    IterableDataset that yields shards as they are committed and ends with the manifest (its
    keyword arguments, e.g. ``poll_seconds``, ``rank``/``world_size``, pass through).
    """

    def __new__(cls, uri: str, *args: Any, follow: bool = False, **kwargs: Any) -> Any:
        if follow:
            from hsx_extractor.follow import FollowedRun

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
