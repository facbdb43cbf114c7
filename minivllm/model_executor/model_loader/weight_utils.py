"""Weight-loading helpers shared by every layer."""

import torch


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (the loader of unsharded parameters)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        # Scalars may arrive as [] or [1]; take the value whatever its shape.
        param.data.copy_(loaded_weight.reshape(param.shape))
        return
    assert param.size() == loaded_weight.size(), (
        f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
    param.data.copy_(loaded_weight)
