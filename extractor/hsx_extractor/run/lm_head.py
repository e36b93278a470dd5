"""The model's own head, read with numpy from its safetensors: lm_head (or the tied embedding), the
final norm's weight and what config.json says about the logits. For the consistency check only.

Nothing is loaded whole: ``LmHead.logits`` streams the head's rows from the file in fixed-size
blocks (``os.pread`` into one reused buffer, so the process holds one block, not the GBs of a big
vocabulary's head), converts each block to float32 and multiplies it with the few states checked.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hsx_extractor.model import ModelConfigError, read_model_config, text_config

# Bytes of head rows read and converted at a time (float32 block: twice this).
BLOCK_BYTES = 16 << 20
_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are in a safetensors file."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte
    nbytes: int


def _header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelConfigError(f"{path} is not a safetensors file (short header)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ModelConfigError(f"{path}: safetensors header of {n} bytes")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ModelConfigError(f"{path}: safetensors header is not an object")
    return header, 8 + n


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index if there is one, else from every file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return {str(k): model_dir / str(v) for k, v in weight_map.items()}
    names: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        header, _ = _header(f)
        names.update({k: f for k in header if k != "__metadata__"})
    return names


def tensor_ref(path: Path, name: str) -> TensorRef:
    header, base = _header(path)
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise ModelConfigError(f"{path} has no tensor {name}")
    dtype = str(entry.get("dtype"))
    if dtype not in _DTYPES:
        raise ModelConfigError(f"{path}: {name} is {dtype}; the consistency check reads BF16, F16 or F32 heads")
    start, stop = (int(x) for x in entry["data_offsets"])
    shape = tuple(int(d) for d in entry["shape"])
    if stop - start != int(np.prod(shape)) * _DTYPES[dtype]:
        raise ModelConfigError(f"{path}: {name} has {stop - start} bytes for shape {shape}")
    return TensorRef(path, name, dtype, shape, base + start, stop - start)


def _pick(names: Mapping[str, Path], suffixes: tuple[str, ...]) -> str | None:
    """The shortest tensor name ending with the first suffix that matches any (multimodal models
    nest the language model's names one level deeper)."""
    for suffix in suffixes:
        found = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
        if found:
            return found[0]
    return None


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw tensor elements (uint16 bits for BF16/F16) as float32 (pure)."""
    if dtype == "BF16":
        wide = raw.astype(np.uint32)
        wide <<= 16  # in place: one float32-sized array per block, not two
        return wide.view(np.float32)
    if dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    return raw.view(np.float32).astype(np.float32, copy=False)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return to_float32(np.ascontiguousarray(bits, dtype=np.uint16), "BF16")


@dataclass(frozen=True)
class HeadConfig:
    """What turns a final state into logits besides the head's matrix (config.json)."""

    rms_norm_eps: float
    norm_offset: float  # Gemma's norms multiply by (1 + weight)
    logit_scale: float | None  # Cohere
    softcap: float | None  # Gemma-2's final_logit_softcapping
    tied: bool


def head_config(config: Mapping[str, Any]) -> HeadConfig:
    text = text_config(config)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    eps = text.get("rms_norm_eps") or text.get("layer_norm_eps") or text.get("norm_eps") or 1e-6
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    return HeadConfig(
        rms_norm_eps=float(eps),
        norm_offset=1.0 if model_type.startswith("gemma") else 0.0,
        logit_scale=float(text["logit_scale"]) if text.get("logit_scale") else None,
        softcap=float(text["final_logit_softcapping"]) if text.get("final_logit_softcapping") else None,
        tied=tied,
    )


def rms_norm(states: np.ndarray, weight: np.ndarray, eps: float, offset: float = 0.0) -> np.ndarray:
    """The final RMSNorm in float32 (pure): x / sqrt(mean(x^2) + eps) * (offset + weight)."""
    x = states.astype(np.float32, copy=False)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv * (np.float32(offset) + weight)).astype(np.float32)


class LmHead:
    """The model's head, streamed from its safetensors file."""

    def __init__(self, model_dir: str | os.PathLike[str], block_bytes: int = BLOCK_BYTES) -> None:
        root = Path(model_dir)
        self.config = head_config(read_model_config(root))
        names = _weight_files(root)
        head = None if self.config.tied else _pick(names, ("lm_head.weight",))
        head = head or _pick(names, ("embed_tokens.weight", "wte.weight", "word_embeddings.weight"))
        if head is None:
            raise ModelConfigError(f"{root}: no lm_head.weight or embed_tokens.weight in its safetensors")
        self.head = tensor_ref(names[head], head)
        if len(self.head.shape) != 2:
            raise ModelConfigError(f"{root}: {head} has shape {self.head.shape}, expected [vocab, hidden]")
        self.vocab_size, self.hidden_size = self.head.shape
        norm = _pick(names, ("model.norm.weight", "norm.weight", "final_layernorm.weight", "ln_f.weight"))
        self._norm_ref = tensor_ref(names[norm], norm) if norm and "layers." not in norm else None
        self._norm: np.ndarray | None = None
        row_bytes = self.hidden_size * _DTYPES[self.head.dtype]
        self.rows_per_block = max(1, block_bytes // row_bytes)
        self._buf = bytearray(self.rows_per_block * row_bytes)

    def _read(self, ref: TensorRef, offset: int, nbytes: int, into: bytearray | None = None) -> memoryview:
        buf = into if into is not None else bytearray(nbytes)
        view = memoryview(buf)[:nbytes]
        fd = os.open(ref.path, os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [view[done:]], ref.offset + offset + done)
                if n <= 0:
                    raise ModelConfigError(f"{ref.path}: {ref.name} ends early")
                done += n
        finally:
            os.close(fd)
        return view

    def norm_weight(self) -> np.ndarray:
        if self._norm_ref is None:
            raise ModelConfigError("the model's final norm weight was not found (needed for pre-norm captures)")
        if self._norm is None:
            raw = np.frombuffer(self._read(self._norm_ref, 0, self._norm_ref.nbytes), dtype=_raw(self._norm_ref))
            self._norm = to_float32(raw, self._norm_ref.dtype)
        return self._norm

    def final_norm(self, states: np.ndarray) -> np.ndarray:
        return rms_norm(states, self.norm_weight(), self.config.rms_norm_eps, self.config.norm_offset)

    def logits(self, states: np.ndarray) -> np.ndarray:
        """``[N, vocab]`` float32 logits of ``[N, hidden]`` float32 post-norm states."""
        x = np.ascontiguousarray(states, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"states of shape {x.shape}, the head takes [N, {self.hidden_size}]")
        # [vocab, N]: block @ states.T keeps both operands C-contiguous, the form OpenBLAS runs
        # fastest with few states (5x the CPU time of states @ block.T, measured at H=7168).
        out_t = np.empty((self.vocab_size, x.shape[0]), dtype=np.float32)
        x_t = np.ascontiguousarray(x.T)
        row_bytes = self.hidden_size * _DTYPES[self.head.dtype]
        for r0 in range(0, self.vocab_size, self.rows_per_block):
            r1 = min(self.vocab_size, r0 + self.rows_per_block)
            raw = np.frombuffer(self._read(self.head, r0 * row_bytes, (r1 - r0) * row_bytes, self._buf), _raw(self.head))
            block = to_float32(raw, self.head.dtype).reshape(r1 - r0, self.hidden_size)
            np.matmul(block, x_t, out=out_t[r0:r1])
        out = np.ascontiguousarray(out_t.T)
        if self.config.logit_scale is not None:
            out *= np.float32(self.config.logit_scale)
        if self.config.softcap is not None:
            c = np.float32(self.config.softcap)
            out = c * np.tanh(out / c)
        return out


def _raw(ref: TensorRef) -> type[np.generic]:
    return np.float32 if ref.dtype == "F32" else np.uint16
