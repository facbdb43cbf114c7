"""LongRoPE ("longrope", formerly "su"; Phi-3): per-frequency rescale factors, short or long."""

import math

import torch

from minivllm.config import get_current_vllm_config_or_none
from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding


def longrope_uses_long_factors(original_max_position_embeddings: int,
                               max_position_embeddings: int) -> bool:
    """Whether this engine rotates with the long factors: its `max_model_len` passes the original
    context. NOTE: one choice per engine, as vLLM makes it: a sequence that crossed the limit
    mid-way would otherwise hold keys rotated with both sets of factors."""
    config = get_current_vllm_config_or_none()
    max_model_len = (config.model_config.max_model_len if config is not None
                     else max_position_embeddings)
    return max_model_len > original_max_position_embeddings


class Phi3LongRoPEScaledRotaryEmbedding(RotaryEmbedding):
    """`inv_freq_i = 1 / (factor_i * base^(2i / rotary_dim))`, cos/sin scaled by an mscale.

    The table is built once from `short_factor` (`original_max_position_embeddings` rows) or
    `long_factor` (`max_position_embeddings` rows), chosen by `longrope_uses_long_factors`.
    The default mscale is `sqrt(1 + ln(s) / ln(original))` with `s = max / original` (1 if s <= 1).
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 original_max_position_embeddings: int, base: float, is_neox_style: bool,
                 dtype: torch.dtype, short_factor: list[float], long_factor: list[float],
                 short_mscale: float | None = None, long_mscale: float | None = None,
                 scaling_factor: float | None = None) -> None:
        if not is_neox_style:
            raise ValueError("Phi3LongRoPEScaledRotaryEmbedding supports only is_neox_style=True")
        for name, factors in (("short_factor", short_factor), ("long_factor", long_factor)):
            if len(factors) != rotary_dim // 2:
                raise ValueError(f"LongRoPE {name} must have rotary_dim / 2 = {rotary_dim // 2} "
                                 f"values, got {len(factors)}")
        self.original_max_position_embeddings = original_max_position_embeddings
        self.short_factor, self.long_factor = list(short_factor), list(long_factor)
        scale = scaling_factor or max_position_embeddings / original_max_position_embeddings
        log_original = math.log(original_max_position_embeddings)
        default_mscale = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / log_original)
        self.short_mscale = default_mscale if short_mscale is None else short_mscale
        self.long_mscale = default_mscale if long_mscale is None else long_mscale
        self.use_long_rope = longrope_uses_long_factors(original_max_position_embeddings,
                                                        max_position_embeddings)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_longrope_inv_freq(self, rescale_factors: list[float]) -> torch.Tensor:
        factors = torch.tensor(rescale_factors, dtype=torch.float)     # [rotary_dim / 2]
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
        return 1.0 / (factors * self.base ** exponents)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        if self.use_long_rope:
            inv_freq = self._compute_longrope_inv_freq(self.long_factor)
            return self._cos_sin_from(inv_freq, self.max_position_embeddings, self.long_mscale)
        inv_freq = self._compute_longrope_inv_freq(self.short_factor)
        return self._cos_sin_from(inv_freq, self.original_max_position_embeddings,
                                  self.short_mscale)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, original_max_position_embeddings="
                f"{self.original_max_position_embeddings}, use_long_rope={self.use_long_rope}")
