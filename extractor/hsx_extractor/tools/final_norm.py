"""A model's final RMSNorm, read from its own directory, to turn pre-norm final states into post-norm ones.

Only the inverse-free direction exists: pre-norm ``x`` -> ``w * x / rms(x)``. Post-norm states cannot
be turned back into pre-norm ones (the per-token scale is gone), so that direction is refused by the
exporter, never approximated.

The arithmetic follows Hugging Face's ``LlamaRMSNorm`` (also Qwen2/3, Mistral, DeepSeek-V3): mean of
squares and rsqrt in float32, the normalised value cast back to the states' dtype, then multiplied
by the weight. Norms of another form (Gemma's ``(1 + w)``) are refused by model type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hsx_extractor.model import (
    NORM_WEIGHT_KEYS,
    ModelConfigError,
    final_norm_weight_file,
    read_model_config,
    text_config,
)

if TYPE_CHECKING:
    import torch

# Model types whose final norm is not ``w * x / rms(x)`` (Gemma scales by ``1 + w``).
OTHER_NORM_FORMS = ("gemma",)


class FinalNormError(ValueError):
    """The model directory does not give a final RMSNorm hsx can apply exactly."""


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor  # [H], the model's dtype
    eps: float
    source: str  # file and key it was read from, for the export's record

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        import torch

        x = states.to(torch.float32)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(states.dtype) * normed.to(states.dtype)).to(states.dtype)


def load_final_norm(model_dir: str | Path, hidden_size: int) -> FinalNorm:
    """The final norm of the model in ``model_dir`` (config.json + safetensors weights)."""
    from safetensors import safe_open

    root = Path(model_dir)
    config = text_config(read_model_config(root))
    model_type = str(config.get("model_type", ""))
    if any(form in model_type for form in OTHER_NORM_FORMS):
        raise FinalNormError(f"model type {model_type!r} does not use a plain RMSNorm (w * x / rms(x))")
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise FinalNormError(f"{root}/config.json has no rms_norm_eps")
    try:
        path, key = final_norm_weight_file(root)
    except ModelConfigError as exc:
        raise FinalNormError(str(exc)) from None
    with safe_open(str(path), framework="pt") as f:
        keys = [key] if key else [k for k in NORM_WEIGHT_KEYS if k in set(f.keys())]
        if not keys:
            raise FinalNormError(f"{path} holds none of {list(NORM_WEIGHT_KEYS)}")
        weight = f.get_tensor(keys[0])
    if tuple(weight.shape) != (hidden_size,):
        raise FinalNormError(
            f"{path}:{keys[0]} has shape {tuple(weight.shape)}, the output's hidden size is {hidden_size}"
        )
    return FinalNorm(weight, float(eps), f"{path.name}:{keys[0]}")
