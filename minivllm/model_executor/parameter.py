"""Parameter helpers: attach loader metadata (`weight_loader`, `output_dim`, ...) to tensors.

minivllm uses vLLM's "v1" loaders only: parameters are plain `nn.Parameter`s carrying attributes,
so `WEIGHT_LOADER_V2_SUPPORTED` is empty and no `BasevLLMParameter` subclasses exist.
"""

from typing import Any

import torch

WEIGHT_LOADER_V2_SUPPORTED: list[str] = []


def set_weight_attrs(weight: torch.Tensor, weight_attrs: dict[str, Any] | None) -> None:
    """Set loader metadata on a parameter; an attribute is never silently overwritten."""
    if weight_attrs is None:
        return
    for key, value in weight_attrs.items():
        assert not hasattr(weight, key), f"Overwriting existing tensor attribute: {key}"
        setattr(weight, key, value)
