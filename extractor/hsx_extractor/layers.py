"""Which layers an EAGLE-3 extraction captures. The one place that decides it.

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
"""

from __future__ import annotations

from collections.abc import Sequence

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
