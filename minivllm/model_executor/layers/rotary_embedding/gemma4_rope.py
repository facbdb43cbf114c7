"""Gemma 4's "proportional" RoPE (its full-attention layers): only the first
`partial_rotary_factor` of each half-head's frequency pairs rotate, with exponents over the
whole head dim (not the rotated width); the other pairs get frequency 0 (cos 1, sin 0).

So the rotation is applied to every feature of the head (NeoX halves), the non-rotated ones
unchanged: `rotary_dim` is the head size here whatever the factor (transformers'
`_compute_proportional_rope_parameters`).
"""

import torch

from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding


class Gemma4RotaryEmbedding(RotaryEmbedding):
    """`rotary_dim` (head_size * partial_rotary_factor) rotated features, spread over the head;
    `factor` divides every frequency (1 in Gemma 4's checkpoints)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, dtype: torch.dtype,
                 factor: float = 1.0) -> None:
        self.rope_angles = rotary_dim // 2                  # rotated pairs per head
        self.nope_angles = head_size // 2 - self.rope_angles
        self.factor = factor
        super().__init__(head_size, head_size, max_position_embeddings, base, is_neox_style,
                         dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        """[head_size / 2]: base^(-2i / head_size) for the rotated pairs, then zeros."""
        exponents = torch.arange(0, 2 * self.rope_angles, 2, dtype=torch.float) / self.head_size
        inv_freq = 1.0 / (base ** exponents)
        inv_freq = torch.cat([inv_freq, torch.zeros(self.nope_angles, dtype=torch.float)])
        return inv_freq / self.factor

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rope_angles={self.rope_angles}, "
                f"nope_angles={self.nope_angles}, base={self.base}, factor={self.factor}, "
                f"is_neox_style={self.is_neox_style}")
