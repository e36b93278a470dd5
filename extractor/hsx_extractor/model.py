"""The model as hsx sees it: its config.json, its shape, and which layers an EAGLE-3 extraction
captures. The one place that reads config.json and decides capture layers.

Convention used everywhere in hsx: a *capture layer* ``j`` means the hidden state at the input
of decoder layer ``j`` (= the output of layer ``j - 1``, the pre-norm residual stream), i.e.
index ``j`` into a Hugging Face model's ``output_hidden_states`` tuple, where index 0 is the
embedding output.

SGLang 0.5.23 (each model's ``set_eagle3_layers_to_capture``, checked against the release's
source by tests/sglang/test_layers_source.py) captures at layer inputs:

* no ids given: inputs of ``[2, N // 2, N - 3]`` for every architecture;
* ids given, Llama/Qwen-style models: inputs of ``[i + 1 for i in ids]`` (an id names the layer
  whose *output* is wanted);
* ids given, DeepSeek-V2/V3 code (also Kimi-K2, whose checkpoints say ``DeepseekV3ForCausalLM``,
  Kimi-K2.5, GLM-MoE-DSA, GLM-4-MoE-Lite, Mistral-Large-3): ``+1`` only when ``ids[0] == 1``,
  otherwise the ids are taken as layer inputs unchanged.

The model's forward loop tests ``i in layers_to_capture`` while walking the layers, so captures
come out in ascending layer order with repeats collapsed, whatever order the ids were given in;
nothing follows the last layer, so its output cannot be captured (gpt-oss and MiniMax-M3 also
capture after it).

vLLM 0.32 (``extract_hidden_states``, each model's ``_maybe_add_hidden_state`` calls) numbers the
other way round: its id ``k`` is the residual stream after ``k`` decoder layers, which is hsx's
capture layer ``k``; id ``N`` (the layer count) is the state after the last layer, before the final
norm. :func:`vllm_layer_ids` and :func:`capture_layers_from_vllm_ids` are the one mapping.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_extractor.protocol import FINAL_POST_NORM, FINAL_PRE_NORM

# The manifest's name for this numbering (capture.layerConvention): layer id j = the input of decoder
# layer j (0-based) = the residual stream after j layers = HF ``hidden_states[j]``.
LAYER_CONVENTION = "layer-input"

# Architectures (HF ``architectures[0]``) whose capture setter takes the DeepSeek rule.
DEEPSEEK_STYLE = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Glm4MoeLiteForCausalLM",
        "GlmMoeDsaForCausalLM",
        "MistralLarge3ForCausalLM",
    }
)
# Architectures whose setter shifts EAGLE-3's default layers by one as well.
DEFAULT_SHIFTED = frozenset({"MiniMaxM3SparseForConditionalGeneration"})
# Architectures whose forward also captures after the last layer (pre-norm final state).
CAPTURES_AFTER_LAST_LAYER = frozenset({"GptOssForCausalLM", "MiniMaxM3SparseForCausalLM"})


def default_capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default: inputs of layers 2, N//2 and N-3 (ascending, repeats collapsed)."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 capture needs at least 4 decoder layers, the model has {num_layers}")
    return sorted({2, num_layers // 2, num_layers - 3})


def capture_layers(architecture: str, num_layers: int, layer_ids: Sequence[int] | None) -> list[int]:
    """The capture layers (layer-input indices, in capture order) SGLang 0.5.23 uses for ``layer_ids``."""
    if not layer_ids:
        default = default_capture_layers(num_layers)
        return [j + 1 for j in default] if architecture in DEFAULT_SHIFTED else default
    ids = [int(i) for i in layer_ids]
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"layer ids {ids} must be distinct and non-negative")
    if architecture in DEEPSEEK_STYLE:
        shifted = [i + 1 for i in ids] if ids[0] == 1 else ids
    else:
        shifted = [i + 1 for i in ids]
    last = num_layers if architecture in CAPTURES_AFTER_LAST_LAYER else num_layers - 1
    for j, given in zip(shifted, ids, strict=True):
        if j > last:
            raise ValueError(
                f"layer id {given} asks for the input of layer {j}, but the model's {num_layers} decoder "
                f"layers can only be captured up to the input of layer {last}"
            )
    return sorted(shifted)


# What each engine's dumps hold as the final state (protocol.FINAL_STATE_KEY): SGLang's hook takes the
# model's output after the final norm; vLLM's extract_hidden_states can only capture before it.
ENGINE_FINAL_STATE = {"sglang": FINAL_POST_NORM, "vllm": FINAL_PRE_NORM}
# What each engine can dump when asked (sglang_hook/prenorm.py keeps SGLang's norm input).
ENGINE_FINAL_STATES = {"sglang": (FINAL_POST_NORM, FINAL_PRE_NORM), "vllm": (FINAL_PRE_NORM,)}


def final_state_problem(engine: str, asked: str | None) -> str | None:
    """Why ``engine`` cannot dump the ``asked`` final state (None: it can, or nothing was asked)."""
    if asked is None or asked in ENGINE_FINAL_STATES[engine]:
        return None
    return (
        f"finalState {asked}: the {engine} engine dumps only {', '.join(ENGINE_FINAL_STATES[engine])} "
        "(hsx export --model applies the final norm when a trainer needs post-norm states)"
    )


def vllm_layer_ids(capture_layers: Sequence[int], num_layers: int) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` for hsx's capture layers: the same numbers (vLLM's
    id k is the input of layer k), ascending, then ``num_layers`` for the (pre-norm) final state."""
    layers = sorted({int(j) for j in capture_layers})
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(f"capture layers {list(capture_layers)} must be inputs of the model's {num_layers} layers")
    return [*layers, num_layers]


def capture_layers_from_vllm_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Inverse of :func:`vllm_layer_ids`: hsx's capture layers from the ids vLLM was started with."""
    ids = [int(i) for i in ids]
    if len(ids) < 2 or ids[-1] != num_layers or vllm_layer_ids(ids[:-1], num_layers) != ids:
        raise ValueError(
            f"vLLM layer ids {ids} are not hsx's: ascending layer inputs, then {num_layers} for the final state"
        )
    return ids[:-1]


class ModelConfigError(ValueError):
    """The model's config.json (or what the server reports) cannot tell hsx what it needs."""


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """The model directory's config.json as a dict."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelConfigError(f"{path} does not exist") from exc
    except ValueError as exc:
        raise ModelConfigError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return data


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config: multimodal ones (Kimi-K2.5, Llama-4) nest it in text_config."""
    return config.get("text_config") or config


@dataclass(frozen=True)
class ModelDims:
    """Hidden size, decoder layers and architecture of a Hugging Face config.json."""

    hidden_size: int
    num_layers: int
    architecture: str


def model_dims(config: Mapping[str, Any]) -> ModelDims:
    text = text_config(config)
    try:
        hidden = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelConfigError(f"model config lacks hidden_size/num_hidden_layers: {exc}") from exc
    archs = config.get("architectures") or text.get("architectures") or [""]
    return ModelDims(hidden_size=hidden, num_layers=layers, architecture=str(archs[0]))


@dataclass(frozen=True)
class ModelShape:
    """What the dumps must look like, from the server (or the model's config.json)."""

    hidden_size: int
    capture_layers: tuple[int, ...]
    vocab_size: int | None
    architecture: str | None
    model_path: str | None
    final_state: str = FINAL_POST_NORM  # protocol.FINAL_POST_NORM or FINAL_PRE_NORM


def _config_if_any(model_path: str | None) -> dict[str, Any]:
    if model_path and (Path(model_path) / "config.json").is_file():
        return read_model_config(model_path)
    return {}


def model_shape(
    info: Mapping[str, Any],
    model_path: str | None,
    aux_layer_ids: Sequence[int] | None = None,
    engine: str = "sglang",
    final_state: str | None = None,
) -> ModelShape:
    """Shape from the server's /get_model_info, falling back to the model's config.json (SGLang reports less).

    SGLang reports no capture layers: then they follow from the architecture, the layer count and
    the server's aux layer ids by SGLang's own convention (:func:`capture_layers`).
    """
    top = _config_if_any(model_path)
    config = text_config(top)
    hidden = info.get("hidden_size") or config.get("hidden_size")
    if not hidden:
        raise ModelConfigError("neither /get_model_info nor the model's config.json gives the hidden size")
    arch = info.get("architecture") or (top.get("architectures") or [None])[0]
    layers = info.get("capture_layers")
    if layers is None:
        n = info.get("num_hidden_layers") or config.get("num_hidden_layers")
        if not n:
            raise ModelConfigError(
                "cannot tell which layers the server captures (no capture_layers, no layer count)"
            )
        try:
            layers = capture_layers(str(arch or ""), int(n), aux_layer_ids)
        except ValueError as exc:
            raise ModelConfigError(f"aux layer ids {aux_layer_ids}: {exc}") from exc
    vocab = info.get("vocab_size") or config.get("vocab_size")
    return ModelShape(
        int(hidden),
        tuple(int(j) for j in layers),
        int(vocab) if vocab else None,
        arch,
        info.get("model_path") or model_path,
        final_state or ENGINE_FINAL_STATE[engine],
    )


def check_vocab(shape: ModelShape, tokenizer_vocab: int, model_path: str | None) -> None:
    """The server must run a model whose vocabulary covers the tokenizer (and is the model's own)."""
    if shape.vocab_size is None:
        return
    if shape.vocab_size < tokenizer_vocab:
        raise ModelConfigError(
            f"the server reports vocab size {shape.vocab_size}, smaller than the tokenizer's {tokenizer_vocab}: "
            "it runs a different model or tokenizer"
        )
    own = text_config(_config_if_any(model_path)).get("vocab_size")
    if own and int(own) != shape.vocab_size:
        raise ModelConfigError(
            f"the server reports vocab size {shape.vocab_size}, {Path(str(model_path)) / 'config.json'} says {own}"
        )


# Files whose bytes say which weights a checkpoint holds, without reading the weights.
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_fingerprint(model_dir: str | Path | None) -> dict[str, str] | None:
    """Digests of a model directory's config.json and of its weights (their index file, else each
    weight file's name and size): what a resumed run checks to refuse a swapped model."""
    if not model_dir or not (Path(model_dir) / "config.json").is_file():
        return None
    root = Path(model_dir)
    weights = hashlib.sha256()
    indexes = [root / name for name in _WEIGHT_INDEXES if (root / name).is_file()]
    if indexes:
        for index in indexes:
            weights.update(index.name.encode() + b"\0" + index.read_bytes())
    else:
        for f in sorted(p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
            weights.update(f"{f.name}\0{f.stat().st_size}\n".encode())
    return {
        "configJson": hashlib.sha256((root / "config.json").read_bytes()).hexdigest()[:16],
        "weights": weights.hexdigest()[:16],
    }


# The final norm's weight, under the names Llama-family and multimodal checkpoints give it.
NORM_WEIGHT_KEYS = ("model.norm.weight", "model.language_model.norm.weight")


def final_norm_weight_file(model_dir: Path) -> tuple[Path, str]:
    """The safetensors file holding the final norm weight, and its key ("" when the file is the only one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        for key in NORM_WEIGHT_KEYS:
            if key in weight_map:
                return model_dir / weight_map[key], key
        raise ModelConfigError(f"{index} maps none of {list(NORM_WEIGHT_KEYS)}")
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ModelConfigError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    return single, ""


def final_norm_digest(model_dir: str | Path | None) -> str | None:
    """``sha256:`` of the final norm weight's stored bytes, read from the safetensors header without
    torch (the extractor image has none); None when the directory has no such weight. A run records
    it so that ``hsx export --model`` applies only the norm that belongs to its states."""
    if not model_dir:
        return None
    try:
        path, key = final_norm_weight_file(Path(model_dir))
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                return None
            header = json.loads(f.read(length))
            keys = [key] if key else [k for k in NORM_WEIGHT_KEYS if k in header]
            entry = header.get(keys[0]) if keys else None
            if not isinstance(entry, dict):
                return None
            begin, end = (int(x) for x in entry["data_offsets"])
            if not 0 <= begin <= end or end - begin > 1 << 24:
                return None
            f.seek(8 + length + begin)
            data = f.read(end - begin)
    except (ModelConfigError, OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return f"sha256:{hashlib.sha256(data).hexdigest()[:32]}"


def model_identity(model_dir: str | Path | None) -> dict[str, Any]:
    """What a run's manifest records to tell its model from another (docs/format.md, ``run``)."""
    return {"modelFingerprint": model_fingerprint(model_dir), "finalNormDigest": final_norm_digest(model_dir)}
