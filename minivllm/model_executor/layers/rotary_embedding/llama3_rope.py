"""Llama 3.1 RoPE: low frequencies divided by `factor`, high ones kept, a smooth ramp between."""

import math

import torch

from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding


class Llama3RotaryEmbedding(RotaryEmbedding):

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, dtype: torch.dtype, scaling_factor: float,
                 low_freq_factor: float, high_freq_factor: float, orig_max_position: int) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq(base)
        factor, low, high = self.scaling_factor, self.low_freq_factor, self.high_freq_factor
        low_freq_wavelen = self.orig_max_position / low
        high_freq_wavelen = self.orig_max_position / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are interpolated by `factor`.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        if low == high:
            return scaled
        smooth = (self.orig_max_position / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
