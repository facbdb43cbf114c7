"""Parameter helpers: loader metadata (`weight_loader`, `output_dim`, ...) and the default loader.

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


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (the loader of unsharded parameters)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        # Scalars may arrive as [] or [1]; take the value whatever its shape.
        param.data.copy_(loaded_weight.reshape(param.shape))
        return
    assert param.size() == loaded_weight.size(), (
        f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
    param.data.copy_(loaded_weight)
