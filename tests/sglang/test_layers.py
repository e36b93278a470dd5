"""The layer-id convention (hsx_extractor.model), as pure functions."""

from __future__ import annotations

import pytest

from hsx_extractor.model import capture_layers, default_capture_layers


def test_default_is_inputs_of_2_half_and_n_minus_3() -> None:
    assert default_capture_layers(32) == [2, 16, 29]
    assert capture_layers("LlamaForCausalLM", 61, None) == [2, 30, 58]
    assert capture_layers("DeepseekV3ForCausalLM", 61, []) == [2, 30, 58]


def test_small_models_capture_each_layer_once() -> None:
    # SGLang tests `i in layers_to_capture`, so a repeated default layer is captured once.
    assert default_capture_layers(6) == [2, 3]
    with pytest.raises(ValueError, match="at least 4"):
        default_capture_layers(3)


def test_llama_and_qwen_add_one_and_capture_in_layer_order() -> None:
    assert capture_layers("Qwen3ForCausalLM", 36, [1, 17, 32]) == [2, 18, 33]
    assert capture_layers("LlamaForCausalLM", 32, [20, 2]) == [3, 21]


def test_deepseek_adds_one_only_when_the_first_id_is_1() -> None:
    assert capture_layers("DeepseekV3ForCausalLM", 61, [1, 29, 57]) == [2, 30, 58]
    assert capture_layers("DeepseekV3ForCausalLM", 61, [0, 29, 57]) == [0, 29, 57]
    assert capture_layers("KimiK25ForConditionalGeneration", 61, [3, 30]) == [3, 30]


def test_the_last_layer_output_cannot_be_captured_except_where_the_model_does() -> None:
    with pytest.raises(ValueError, match="layer id 31 asks for the input of layer 32"):
        capture_layers("LlamaForCausalLM", 32, [2, 31])
    assert capture_layers("GptOssForCausalLM", 24, [2, 23]) == [3, 24]
    with pytest.raises(ValueError):
        capture_layers("DeepseekV3ForCausalLM", 61, [2, 61])


@pytest.mark.parametrize("ids", [[2, 2, 5], [-1, 3]])
def test_bad_ids_are_refused(ids: list[int]) -> None:
    with pytest.raises(ValueError, match="distinct and non-negative"):
        capture_layers("LlamaForCausalLM", 32, ids)
