"""The dump protocol between an extraction server and the extractor.

Both producers (the SGLang hook and the CPU reference server) and the one consumer (the
extractor) import this module; nothing else defines file names or the dump layout.
See docs/protocol.md for the one-page spec.

A request sent by the extractor carries its own request id (``rid``, see :func:`make_rid`).
For that rid the server writes exactly one file into the dump directory:

* ``{rid}.safetensors`` - a safetensors file with three tensors
  ``input_ids`` (I32 ``[L]``, the ids the server actually ran), ``aux_hidden_states``
  (BF16 ``[L, K*H]``, K captured layers concatenated in capture order) and ``hidden_states``
  (BF16 ``[L, H]``, the post-norm final state), plus ``__metadata__`` (see :class:`DumpMeta`).
* or ``{rid}.error.json`` - the server saw something wrong with that request (for example a
  row-count mismatch) and refuses to write data for it.

Either file is first written under a hidden temporary name (``.{rid}.{pid}.partial``) and
renamed into place when complete, so a visible name always means a complete file.

Only numpy is needed here (to read dumps): tensors are raw little-endian buffers (bf16 travels as its 16 bits).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is imported where dumps are read: the operator imports this module's names
    import numpy as np

PROTOCOL_VERSION = "hsx-dump/1"
# Environment variable naming the dump directory, read by the SGLang hook and the reference server.
DUMP_DIR_ENV = "SGLANG_HS_DUMP_DIR"
DUMP_SUFFIX = ".safetensors"
ERROR_SUFFIX = ".error.json"
PARTIAL_SUFFIX = ".partial"

# vLLM rewrites request ids, so the rid travels in the request body's kv_transfer_params under this
# key, to hsx's connector (hsx_extractor.vllm_hook).
VLLM_RID_PARAM = "hsx_rid"

# Meta key saying what the hidden_states tensor holds: the state after the model's final norm
# (SGLang's hook; also what a dump without the key means) or before it (vLLM's connector).
FINAL_STATE_KEY = "final_state"
FINAL_POST_NORM = "post-norm"
FINAL_PRE_NORM = "pre-norm"

TENSOR_INPUT_IDS = "input_ids"
TENSOR_AUX = "aux_hidden_states"
TENSOR_FINAL = "hidden_states"

_RID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_RID_PREFIX = "hsx"


class ProtocolError(ValueError):
    """A dump file or rid does not follow the protocol."""


def validate_rid(rid: str) -> str:
    """Return ``rid`` if it is safe as a file name; raise :class:`ProtocolError` otherwise."""
    if not isinstance(rid, str) or not _RID_RE.match(rid) or ".." in rid:
        raise ProtocolError(f"invalid rid {rid!r}: use 1-200 of [A-Za-z0-9._-], starting alphanumeric")
    return rid


@dataclass(frozen=True)
class RunKey:
    """Who sends a rid: run, replica (pod), worker in the pod and one extractor process
    (``{run_id}-r{replica}-{process}``, or ``{run_id}-r{replica}w{worker}-{process}`` for worker > 0).

    Replica and worker are a *slot*: one live process at a time. ``process`` is fresh hex per extractor
    process, so a restarted extractor never reuses a rid the server has seen, and the dumps of a dead
    earlier process of the same slot can be told from the live one's (and from its sibling workers').
    Parsed from the right (the process is hex, the slot ``r`` + digits), so a runId that itself looks
    like ``job-r1`` is never taken for replica 1 of ``job``.
    """

    run_id: str
    replica: int
    process: str
    worker: int = 0

    def __post_init__(self) -> None:
        if not self.run_id or self.replica < 0 or self.worker < 0 or not _PROCESS_RE.match(self.process):
            raise ProtocolError(f"invalid run key parts {self.run_id!r}, {self.replica!r}, {self.process!r}")

    @property
    def slot(self) -> str:
        return f"r{self.replica}" + (f"w{self.worker}" if self.worker else "")

    @property
    def text(self) -> str:
        return f"{self.run_id}-{self.slot}-{self.process}"

    def same_slot(self, other: RunKey) -> bool:
        return (self.run_id, self.replica, self.worker) == (other.run_id, other.replica, other.worker)

    @classmethod
    def parse(cls, text: str) -> RunKey:
        m = _RUN_KEY_RE.match(text)
        if not m:
            raise ProtocolError(f"run key {text!r} is not {{runId}}-r{{replica}}[w{{worker}}]-{{process}}")
        return cls(m.group(1), int(m.group(2)), m.group(4), int(m.group(3) or 0))


_PROCESS_RE = re.compile(r"^[0-9a-f]{1,32}$")
_RUN_KEY_RE = re.compile(r"^(.+)-r(\d+)(?:w(\d+))?-([0-9a-f]{1,32})$")


def make_rid(run_key: str | RunKey, sample_index: int, attempt: int) -> str:
    """The rid of one attempt at one sample: ``hsx-{run_key}-{index}-a{attempt}``.

    A retry gets a new rid, so a late dump of an abandoned attempt can never be taken for the
    retry's. ``run_key`` should differ between runs and replicas (SGLang rejects duplicate rids).
    """
    if sample_index < 0 or attempt < 0:
        raise ProtocolError("sample_index and attempt must be >= 0")
    key = run_key.text if isinstance(run_key, RunKey) else run_key
    return validate_rid(f"{_RID_PREFIX}-{key}-{sample_index}-a{attempt}")


def parse_rid(rid: str) -> tuple[str, int, int]:
    """Inverse of :func:`make_rid`: ``(run_key, sample_index, attempt)``."""
    m = re.match(rf"^{_RID_PREFIX}-(.+)-(\d+)-a(\d+)$", rid)
    if not m:
        raise ProtocolError(f"rid {rid!r} was not made by make_rid")
    return m.group(1), int(m.group(2)), int(m.group(3))


def owner_of(rid: str) -> RunKey | None:
    """The :class:`RunKey` that sent ``rid``; None for a rid not made by :func:`make_rid` with one."""
    try:
        return RunKey.parse(parse_rid(rid)[0])
    except ProtocolError:
        return None


class DumpDirError(OSError):
    """The dump directory cannot be shared by the server and the extractor."""


# Both containers of a pod create, rename and delete files here, as different users (the server as
# the image's root without CAP_DAC_OVERRIDE, the extractor as uid 65532): only mode 777 (no sticky
# bit) lets each delete the other's files. The directory is on the pod's own tmpfs.
DUMP_DIR_MODE = 0o777


def make_dump_dir(path: str | os.PathLike[str], wait_s: float = 10.0) -> Path:
    """Create the dump directory (or take the one the other container made) with DUMP_DIR_MODE."""
    import time

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        st = directory.stat()
        if st.st_mode & 0o1777 == DUMP_DIR_MODE:
            return directory
        try:
            os.chmod(directory, DUMP_DIR_MODE)  # mkdir's mode was cut by the umask
            return directory
        except PermissionError:
            # The other container made it a moment ago and is about to chmod it.
            if time.monotonic() > deadline:
                raise DumpDirError(
                    f"dump directory {directory} is mode {st.st_mode & 0o7777:o}, owned by uid {st.st_uid}: "
                    f"the server and the extractor run as different users and both must create and delete "
                    f"files in it; make it mode {DUMP_DIR_MODE:o}"
                ) from None
            time.sleep(0.1)


def dump_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    return Path(dump_dir) / f"{validate_rid(rid)}{DUMP_SUFFIX}"


def error_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    return Path(dump_dir) / f"{validate_rid(rid)}{ERROR_SUFFIX}"


def rid_of(name: str) -> str | None:
    """The rid a complete dump or error file name belongs to; None for partial or foreign files."""
    if name.startswith("."):
        return None
    for suffix in (DUMP_SUFFIX, ERROR_SUFFIX):
        if name.endswith(suffix):
            rid = name[: -len(suffix)]
            return rid if _RID_RE.match(rid) else None
    return None


@dataclass(frozen=True)
class DumpMeta:
    """What a producer records about one dump."""

    rid: str
    seq_len: int
    hidden_size: int
    # Decoder-layer indices whose *input* was captured, in capture order; equal to the indices
    # into a Hugging Face model's ``output_hidden_states`` tuple (0 = embeddings).
    capture_layers: tuple[int, ...]
    producer: str
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def num_aux(self) -> int:
        return len(self.capture_layers)

    @property
    def final_state(self) -> str:
        """FINAL_POST_NORM or FINAL_PRE_NORM (see FINAL_STATE_KEY)."""
        return self.extra.get(FINAL_STATE_KEY, FINAL_POST_NORM)

    def to_header(self) -> dict[str, str]:
        header = dict(self.extra)
        header.update(
            protocol=PROTOCOL_VERSION,
            rid=self.rid,
            seq_len=str(self.seq_len),
            hidden_size=str(self.hidden_size),
            capture_layers=json.dumps(list(self.capture_layers)),
            producer=self.producer,
        )
        return header

    @classmethod
    def from_header(cls, header: dict[str, str]) -> DumpMeta:
        if header.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"dump protocol {header.get('protocol')!r}, expected {PROTOCOL_VERSION!r}")
        known = {"protocol", "rid", "seq_len", "hidden_size", "capture_layers", "producer"}
        try:
            return cls(
                rid=header["rid"],
                seq_len=int(header["seq_len"]),
                hidden_size=int(header["hidden_size"]),
                capture_layers=tuple(int(x) for x in json.loads(header["capture_layers"])),
                producer=header["producer"],
                extra={k: v for k, v in header.items() if k not in known},
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ProtocolError(f"bad dump metadata: {exc}") from exc


@dataclass
class Dump:
    """One complete dump, as read back. bf16 tensors are ``uint16`` arrays of their bits."""

    meta: DumpMeta
    input_ids: np.ndarray  # int32 [L]
    aux_hidden_states: np.ndarray  # uint16 (bf16 bits) [L, K*H]
    hidden_states: np.ndarray  # uint16 (bf16 bits) [L, H]


def _tensor_entries(meta: DumpMeta, n_ids: int, n_aux_rows: int, n_final_rows: int) -> dict[str, Any]:
    k, h = meta.num_aux, meta.hidden_size
    specs = [
        (TENSOR_INPUT_IDS, "I32", [n_ids], n_ids * 4),
        (TENSOR_AUX, "BF16", [n_aux_rows, k * h], n_aux_rows * k * h * 2),
        (TENSOR_FINAL, "BF16", [n_final_rows, h], n_final_rows * h * 2),
    ]
    entries: dict[str, Any] = {"__metadata__": meta.to_header()}
    offset = 0
    for name, dtype, shape, nbytes in specs:
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return entries


# Room for a dump's safetensors header (tensor table and metadata), which is a few hundred bytes.
HEADER_ALLOWANCE = 4096


def dump_bytes_bound(seq_len: int, hidden_size: int, num_aux: int) -> int:
    """Bytes a dump of ``seq_len`` rows takes on disk, header included (an upper bound)."""
    return 8 + HEADER_ALLOWANCE + seq_len * (4 + 2 * hidden_size * (num_aux + 1))


def _encode_header(entries: dict[str, Any]) -> bytes:
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def rid_of_partial(name: str) -> str | None:
    """The rid a partial file (``.{final name}.{pid}.partial``, see _atomic_write) is being written
    for; None for any other name."""
    if not (name.startswith(".") and name.endswith(PARTIAL_SUFFIX)):
        return None
    final, _, pid = name[1 : -len(PARTIAL_SUFFIX)].rpartition(".")
    return rid_of(final) if pid.isdigit() else None


def _atomic_write(final: Path, chunks: Iterable[bytes | memoryview]) -> None:
    tmp = final.with_name(f".{final.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_dump(
    dump_dir: str | os.PathLike[str],
    meta: DumpMeta,
    input_ids: Any,
    aux_hidden_states: Any,
    hidden_states: Any,
) -> Path:
    """Write one dump atomically. Tensors are buffers (numpy arrays, bytes, memoryviews) holding
    int32 ids and bf16 bits in C order; aux and final may each be a list of such buffers holding
    consecutive rows (prefill chunks), written one after another without a join. The row counts are
    written as given - the consumer, not the producer, decides whether they match what was sent -
    but byte sizes must agree with the row counts, so a torn buffer cannot pass as a shorter tensor."""
    ids = memoryview(input_ids).cast("B")
    aux = _byte_pieces(aux_hidden_states)
    fin = _byte_pieces(hidden_states)
    aux_bytes, fin_bytes = sum(p.nbytes for p in aux), sum(p.nbytes for p in fin)
    k, h = meta.num_aux, meta.hidden_size
    if ids.nbytes % 4 or any(p.nbytes % (2 * k * h) for p in aux) or any(p.nbytes % (2 * h) for p in fin):
        raise ProtocolError("tensor byte sizes are not whole rows")
    entries = _tensor_entries(meta, ids.nbytes // 4, aux_bytes // (2 * k * h), fin_bytes // (2 * h))
    path = dump_path(dump_dir, meta.rid)
    _atomic_write(path, [_encode_header(entries), ids, *aux, *fin])
    return path


def _byte_pieces(tensor: Any) -> list[memoryview]:
    pieces = tensor if isinstance(tensor, list | tuple) else [tensor]
    return [memoryview(p).cast("B") for p in pieces]


def write_error(dump_dir: str | os.PathLike[str], rid: str, reason: str, message: str) -> Path:
    """Tell the extractor that this rid will get no data, and why."""
    path = error_path(dump_dir, rid)
    body = json.dumps({"protocol": PROTOCOL_VERSION, "rid": rid, "reason": reason, "message": message})
    _atomic_write(path, [body.encode()])
    return path


def read_error(path: str | os.PathLike[str]) -> dict[str, str]:
    with open(path, "rb") as f:
        body = json.loads(f.read())
    if not isinstance(body, dict) or "reason" not in body:
        raise ProtocolError(f"{path}: not an error marker")
    return {str(k): str(v) for k, v in body.items()}


_DTYPES = {"I32": "<i4", "BF16": "<u2"}


def read_dump(path: str | os.PathLike[str]) -> Dump:
    """Read and structurally check one dump. Raises :class:`ProtocolError` on any damage.

    The file is mapped, not copied: the arrays are read-only views of its pages, valid after the
    file is removed. Dumps are renamed into place complete and never rewritten, so the mapping
    cannot shrink under a reader.
    """

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ProtocolError(f"{path}: truncated header")
        # Populated at map time: faulting 4 KiB pages one by one during the copies that follow
        # ran ~5x slower (bench/b1_dataplane.py).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        data = memoryview(mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ))
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > len(data) - 8:
        raise ProtocolError(f"{path}: header length {hlen} exceeds file size")
    try:
        header = json.loads(bytes(data[8 : 8 + hlen]))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"{path}: header is not JSON: {exc}") from exc
    body = data[8 + hlen :]
    try:
        if not isinstance(header, dict):
            raise ProtocolError("header is not a JSON object")
        meta = DumpMeta.from_header(header.get("__metadata__", {}))
        arrays = {name: _tensor(header, body, name) for name in (TENSOR_INPUT_IDS, TENSOR_AUX, TENSOR_FINAL)}
    except ProtocolError as exc:
        raise ProtocolError(f"{path}: {exc}") from exc
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as exc:
        # A header of the right JSON but the wrong shapes (a writer's bug, a damaged file): that
        # sample's quarantine, never the run's end.
        raise ProtocolError(f"{path}: malformed header ({type(exc).__name__}: {exc})") from exc
    return Dump(meta, arrays[TENSOR_INPUT_IDS], arrays[TENSOR_AUX], arrays[TENSOR_FINAL])


def _tensor(header: dict[str, Any], body: memoryview, name: str) -> Any:
    import numpy as np

    entry = header.get(name)
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        raise ProtocolError(f"missing or mistyped tensor {name!r}")
    start, end = (int(o) for o in entry["data_offsets"])
    dtype = np.dtype(_DTYPES[entry["dtype"]])
    shape = tuple(int(s) for s in entry["shape"])
    if min(shape, default=0) < 0 or not 0 <= start <= end:
        raise ProtocolError(f"tensor {name!r} has a negative shape or offsets out of order")
    if end > len(body) or end - start != int(np.prod(shape)) * dtype.itemsize:
        raise ProtocolError(f"tensor {name!r} is truncated")
    return np.frombuffer(body[start:end], dtype=dtype).reshape(shape)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bf16 bits of float32 ``values`` rounded to nearest even, NaN kept NaN (as torch converts)."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = 0x7FC0
    return rounded


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bf16 ``bits`` (exact)."""
    import numpy as np

    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
