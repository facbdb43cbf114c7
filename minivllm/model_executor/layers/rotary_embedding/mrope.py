"""`MRotaryEmbedding`: multimodal RoPE (Qwen2-VL family): with [3, T] positions each rotated
frequency takes its angle from the T, H or W position of the token, by sections.

`get_rope` builds it when the default-type rope parameters carry `mrope_section` (Qwen2-VL,
Qwen2.5-VL: sectioned; Qwen3-VL: `mrope_interleaved`). minivllm's runner passes 1-D positions
[T] (text only: the T, H and W positions of a text token are equal), which rotate exactly like
the plain `RotaryEmbedding` and take its native bf16 kernel; [3, T] comes from vLLM callers.

NOTE: vLLM sizes the cos/sin table `positions_factor` (4) times `max_position_embeddings` for
video positions. minivllm never produces those (a text position is below the token count), so
the table stays `max_position_embeddings` long and `positions_factor` is only recorded.
"""

import torch

from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding


def mrope_axis_of_frequency(mrope_section: list[int], interleaved: bool) -> torch.Tensor:
    """int64 [rotary_dim / 2]: which position row (0 T, 1 H, 2 W) each frequency reads.
    Sectioned: the first s_T frequencies T, the next s_H H, the rest W. Interleaved: frequency i
    is H when i % 3 == 1 and i < 3 s_H, W when i % 3 == 2 and i < 3 s_W, else T."""
    half = sum(mrope_section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
    freq = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.long)
    axis[(freq % 3 == 1) & (freq < 3 * mrope_section[1])] = 1
    axis[(freq % 3 == 2) & (freq < 3 * mrope_section[2])] = 2
    return axis


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose positions may be [3, T] (T / H / W); vLLM 0.33's leading arguments."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, dtype: torch.dtype,
                 mrope_section: list[int] | None = None, mrope_interleaved: bool = False,
                 *, positions_factor: int = 4, scaling_factor: float | None = None) -> None:
        if scaling_factor is not None:
            raise NotImplementedError("MRotaryEmbedding with YaRN scaling is not supported")
        if mrope_section is not None and (len(mrope_section) != 3
                                          or sum(mrope_section) != rotary_dim // 2):
            raise ValueError(f"mrope_section must hold 3 counts summing to rotary_dim // 2 = "
                             f"{rotary_dim // 2}, got {mrope_section}")
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                         dtype)
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved
        self.positions_factor = positions_factor

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """positions [T] or [3, T], query [T, nH * d], key [T, nKV * d] -> rotated."""
        if positions.dim() == 1:
            return super().forward_native(positions, query, key)
        if not self.mrope_section:
            raise ValueError("[3, T] positions need an mrope_section")
        half = self.rotary_dim // 2
        axis = mrope_axis_of_frequency(self.mrope_section, self.mrope_interleaved)
        pos = positions[axis.to(positions.device)].t()                    # [T, half]
        cache = self._match_cos_sin_cache(query)
        cos = cache[:, :half].gather(0, pos)                              # [T, half]
        sin = cache[:, half:].gather(0, pos)
        num_tokens = positions.shape[-1]
        query = self._rotate(query, cos, sin, num_tokens)
        if key is not None:
            key = self._rotate(key, cos, sin, num_tokens)
        return query, key

    def _rotates_plainly(self, positions: torch.Tensor) -> bool:
        return positions.dim() == 1             # one position per token: plain RoPE
