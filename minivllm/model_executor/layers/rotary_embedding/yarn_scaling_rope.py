"""YaRN RoPE: interpolate low frequencies, extrapolate high ones, scale cos/sin by an mscale."""

import torch

from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from minivllm.model_executor.layers.rotary_embedding.common import (yarn_find_correction_range,
                                                                    yarn_get_mscale,
                                                                    yarn_linear_ramp_mask)


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """`max_position_embeddings` is the *original* context; the table has `original * factor` rows."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, scaling_factor: float, dtype: torch.dtype, *,
                 beta_fast: float = 32, beta_slow: float = 1, mscale: float | None = None,
                 mscale_all_dim: float | None = None, attention_factor: float | None = None,
                 truncate: bool = True) -> None:
        self.scaling_factor = scaling_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.truncate = truncate
        if attention_factor is not None:
            self.mscale = float(attention_factor)
        elif mscale and mscale_all_dim:
            self.mscale = float(yarn_get_mscale(scaling_factor, mscale)
                                / yarn_get_mscale(scaling_factor, mscale_all_dim))
        else:
            self.mscale = yarn_get_mscale(scaling_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, scaling_factor: float) -> torch.Tensor:
        pos_freqs = self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float)
                                  / self.rotary_dim)
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (scaling_factor * pos_freqs)
        low, high = yarn_find_correction_range(self.beta_fast, self.beta_slow, self.rotary_dim,
                                               self.base, self.max_position_embeddings,
                                               self.truncate)
        # 1 where the frequency is kept (extrapolated), 0 where it is interpolated.
        extrapolation = 1 - yarn_linear_ramp_mask(low, high, self.rotary_dim // 2).to(pos_freqs.device)
        return (inv_freq_interpolation * (1 - extrapolation)
                + inv_freq_extrapolation * extrapolation)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.scaling_factor)
        rows = int(self.max_position_embeddings * self.scaling_factor)
        return self._cos_sin_from(inv_freq, rows, self.mscale)
