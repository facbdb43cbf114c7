"""Formulas shared by the scaled RoPE variants (YaRN correction range and attention scale)."""

import math

import torch


def yarn_find_correction_dim(num_rotations: float, dim: int, base: float,
                             max_position_embeddings: int) -> float:
    """The feature index whose wavelength completes `num_rotations` turns over the context."""
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (
        2 * math.log(base))


def yarn_find_correction_range(low_rot: float, high_rot: float, dim: int, base: float,
                               max_position_embeddings: int,
                               truncate: bool = True) -> tuple[float, float]:
    low = yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings)
    high = yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_linear_ramp_mask(low: float, high: float, dim: int) -> torch.Tensor:
    """0 below `low`, 1 above `high`, linear in between; `[dim]` fp32."""
    if low == high:
        high += 0.001  # avoid a division by zero
    ramp = (torch.arange(dim, dtype=torch.float32) - low) / (high - low)
    return torch.clamp(ramp, 0, 1)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
