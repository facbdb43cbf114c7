"""`MLAAttention`: multi-head latent attention on a paged cache of one latent row per token.

Called by `MultiHeadLatentAttentionWrapper` (`layers/mla.py`) as `mla_attn(q, kv_c_normed, k_pe)`
after the query projection and RoPE; the math and the cache layout are in
`backends/cpu_mla_attn.py`. It is an `Attention` of one KV head whose cache row is the latent
(width kv_lora_rank + qk_rope_head_dim) and whose output per head has v_head_dim values, so the
runner sizes, allocates and binds its cache like any other attention layer's.
"""

from typing import Any

import torch
from torch import nn

from minivllm.config import CacheConfig
from minivllm.model_executor.layers.attention.attention import Attention
from minivllm.model_executor.layers.attention.backends.cpu_mla_attn import CPUMLABackend
from minivllm.model_executor.layers.quantization.utils.quant_utils import (
    get_and_maybe_dequant_weights)


class MLAAttention(Attention):
    """q [T, nH, Dn+R], kv_c_normed [T, L], k_pe [T, 1, R] -> [T, nH*Dv] (this rank's heads)."""

    def __init__(self, num_heads: int, scale: float, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None,
                 kv_lora_rank: int, kv_b_proj: nn.Module, cache_config: CacheConfig | None = None,
                 quant_config: Any = None, prefix: str = "", use_sparse: bool = False,
                 indexer: nn.Module | None = None, **unused: Any) -> None:
        if use_sparse or indexer is not None:
            raise NotImplementedError(
                "sparse MLA (DeepSeek-V3.2's index_topk indexer) is not supported on CPU; "
                "dense MLA (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash) is")
        if getattr(kv_b_proj, "bias", None) is not None:
            raise ValueError("MLA's kv_b_proj must have no bias: its weight is absorbed into "
                             "the query and the output")
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_kv_heads=1,
                         cache_config=cache_config, quant_config=quant_config, prefix=prefix,
                         attn_backend=CPUMLABackend, head_size_v=v_head_dim,
                         kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                         qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
        if self.kv_cache_torch_dtype.itemsize == 1:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: fp8 caches serve the "
                             "standard attention layers only; MLA layers take auto, bfloat16, "
                             "float16 or float32")
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.q_lora_rank = q_lora_rank
        # A plain attribute list, not a submodule: the wrapper owns kv_b_proj (and its prefix).
        self._kv_b_proj = [kv_b_proj]
        # Its forward never runs (the weight is absorbed), so a LoRA delta on it would be lost.
        kv_b_proj.lora_unsupported = "absorbed into multi-head latent attention"
        self._w_kv_dequantised: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                output_shape: torch.Size | tuple[int, ...] | None = None,
                **unused: Any) -> torch.Tensor:
        num_tokens = q.shape[0]
        # The cache row: [c_kv, k_pe] [T, L+R]; the backend attends q [T, nH*(Dn+R)] to it.
        latent = torch.cat((kv_c_normed, k_pe.reshape(num_tokens, -1)), dim=-1)
        out = super().forward(q.reshape(num_tokens, -1), latent, None)
        return out if output_shape is None else out.view(output_shape)

    @property
    def _writes_kv_cache(self) -> bool:
        return False                  # the backend writes the latent rows itself

    def get_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return CPUMLABackend.get_kv_cache_shape(num_blocks, block_size, 1, self.head_size)

    def kv_b_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's weight [nH*(Dn+Dv), L] in `dtype`: the live parameter when it is a plain
        one of that dtype (the loader may still move it), else one dequantised copy, made on
        first use."""
        cached = self._w_kv_dequantised
        if cached is not None and cached.dtype == dtype:
            return cached
        linear = self._kv_b_proj[0]
        weight = get_and_maybe_dequant_weights(linear, dtype)
        if weight is not getattr(linear, "weight", None):
            self._w_kv_dequantised = weight
        return weight
