"""Linear (position-interpolation) RoPE: every position is divided by `factor`."""

import torch

from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """The table covers `max_position * factor` positions."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, scaling_factor: float,
                 dtype: torch.dtype) -> None:
        self.scaling_factor = float(scaling_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        # pos / factor * inv_freq == pos * (inv_freq / factor); the latter matches transformers bit for bit.
        inv_freq = self._compute_inv_freq(self.base) / self.scaling_factor
        return self._cos_sin_from(inv_freq, int(self.max_position_embeddings * self.scaling_factor))
