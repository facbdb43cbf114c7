"""Dynamic-NTK RoPE (vLLM 0.33 formula): a larger base, fixed at construction."""

import torch

from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    """base' = base * (factor * max_position / max_trained_positions - (factor - 1))^(d / (d - 2)).

    NOTE: with the default `max_trained_positions = max_position` the bracket is 1 (no scaling).
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, scaling_factor: float, dtype: torch.dtype,
                 max_trained_positions: int | None = None) -> None:
        self.scaling_factor = scaling_factor
        self.max_trained_positions = max_trained_positions or max_position_embeddings
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        max_len = self.max_position_embeddings
        factor = self.scaling_factor
        base = self.base * ((factor * max_len / self.max_trained_positions) - (factor - 1)) ** (
            self.rotary_dim / (self.rotary_dim - 2))
        return self._cos_sin_from(self._compute_inv_freq(base), max_len)


class DynamicNTKAlphaRotaryEmbedding(RotaryEmbedding):
    """NTK-alpha RoPE: base' = base * alpha^(d / (d - 2))."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, scaling_alpha: float,
                 dtype: torch.dtype) -> None:
        self.scaling_alpha = scaling_alpha
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        base = self.base * self.scaling_alpha ** (self.rotary_dim / (self.rotary_dim - 2))
        return self._cos_sin_from(self._compute_inv_freq(base), self.max_position_embeddings)
