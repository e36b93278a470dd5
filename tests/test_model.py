"""The extractor's idea of the dump shape when the server, like SGLang, does not report capture layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsx_extractor.model import ModelConfigError, model_shape

# What SGLang 0.5.23's /get_model_info answers: no hidden size, no layers, no capture layers.
SGLANG_INFO = {"model_path": "/models/m", "tokenizer_path": "/models/m", "is_generation": True}


def write_config(root: Path, config: dict) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def test_llama_layer_ids_are_shifted_by_one(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "llama",
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32},
    )
    shape = model_shape(SGLANG_INFO, path, [1, 15, 28])
    assert shape.capture_layers == (2, 16, 29) and shape.hidden_size == 4096
    assert model_shape(SGLANG_INFO, path, None).capture_layers == (2, 16, 29)


def test_kimi_k25_reads_text_config_and_takes_the_deepseek_rule(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "kimi",
        {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840},
        },
    )
    assert model_shape(SGLANG_INFO, path, [1, 29, 57]).capture_layers == (2, 30, 58)
    unshifted = model_shape(SGLANG_INFO, path, [2, 30, 58])
    assert unshifted.capture_layers == (2, 30, 58) and unshifted.hidden_size == 7168
    assert unshifted.architecture == "KimiK25ForConditionalGeneration"


def test_a_reported_capture_list_wins_and_bad_ids_fail_permanently(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "llama",
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 8},
    )
    assert model_shape({"capture_layers": [2, 4, 5]}, path, [0, 1, 2]).capture_layers == (2, 4, 5)
    with pytest.raises(ModelConfigError, match="layer id 7"):
        model_shape(SGLANG_INFO, path, [1, 3, 7])


def test_vllm_layer_ids_are_capture_layers_then_the_layer_count() -> None:
    """vLLM's id k is the residual stream after k layers = hsx's capture layer k (input of layer k);
    the layer count is appended for the final state. The same spec gives both engines one set."""
    from hsx_extractor.model import capture_layers, capture_layers_from_vllm_ids, vllm_layer_ids

    default = capture_layers("LlamaForCausalLM", 32, None)
    assert vllm_layer_ids(default, 32) == [2, 16, 29, 32]
    assert vllm_layer_ids(capture_layers("LlamaForCausalLM", 32, [1, 15, 28]), 32) == [2, 16, 29, 32]
    assert vllm_layer_ids([5, 0, 3], 8) == [0, 3, 5, 8]  # ascending: vLLM captures in layer order
    assert capture_layers_from_vllm_ids([0, 3, 5, 8], 8) == [0, 3, 5]
    for bad in ([8], [], [-1]):
        with pytest.raises(ValueError):
            vllm_layer_ids(bad, 8)
    for ids in ([0, 3, 5], [0, 3, 5, 7], [3, 0, 8]):  # no final id, wrong final id, not ascending
        with pytest.raises(ValueError):
            capture_layers_from_vllm_ids(ids, 8)
