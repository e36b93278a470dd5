"""Which layers an EAGLE-3 extraction captures. The one place that decides it.

Convention used everywhere in hsx: a *capture layer* ``j`` means the hidden state at the input
of decoder layer ``j`` (= the output of layer ``j - 1``), i.e. index ``j`` into a Hugging Face
model's ``output_hidden_states`` tuple, where index 0 is the embedding output.

SGLang 0.5.23 (``set_eagle3_layers_to_capture``) captures at layer inputs:
* no ids given: inputs of ``[2, N // 2, N - 3]`` for every architecture;
* ids given, Llama/Qwen-style models: inputs of ``[i + 1 for i in ids]`` (an id names the layer
  whose *output* is wanted);
* ids given, DeepSeek-V2/V3 (and Kimi-K2, which uses that code): ``+1`` only when ``ids[0] == 1``,
  otherwise the ids are taken as layer inputs unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

# Architectures (HF ``architectures[0]``) that take the DeepSeek rule.
DEEPSEEK_STYLE = frozenset(
    {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK2ForCausalLM", "DeepseekV32ForCausalLM"}
)


def default_capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default: inputs of layers 2, N//2 and N-3."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 capture needs at least 4 decoder layers, the model has {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def capture_layers(architecture: str, num_layers: int, layer_ids: Sequence[int] | None) -> list[int]:
    """The capture layers (layer-input indices) SGLang 0.5.23 uses for ``layer_ids``."""
    if not layer_ids:
        return default_capture_layers(num_layers)
    ids = [int(i) for i in layer_ids]
    if architecture in DEEPSEEK_STYLE:
        shifted = [i + 1 for i in ids] if ids[0] == 1 else ids
    else:
        shifted = [i + 1 for i in ids]
    for j in shifted:
        if not 0 < j <= num_layers:
            raise ValueError(f"layer id {j - 1} is outside the model's {num_layers} decoder layers")
    return shifted
