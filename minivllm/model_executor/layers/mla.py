"""Multi-head latent attention (DeepSeek-V2's MLA) as vLLM's model files build it.

A file creates its projections, puts them in `MLAModules` and hands them to
`MultiHeadLatentAttentionWrapper`, which runs the whole block, hidden [T, H] -> [T, H]:

    q      = q_b_proj(q_a_layernorm(q_a))  or q_proj(x)       [T, nH, Dn + R]
    c_kv, k_pe = kv_a_proj_with_mqa(x) (or the kv part of fused_qkv_a_proj(x))  [T, L], [T, R]
    RoPE on q[..., Dn:] and k_pe; attention on the latent cache (`MLAAttention`); o_proj

where L = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim; kv_b_proj maps the latent to
each head's no-RoPE key and value and is applied inside the attention (see
`attention/backends/cpu_mla_attn.py`).
"""

from dataclasses import dataclass
from typing import Any

import torch

from minivllm.config import CacheConfig
from minivllm.model_executor.custom_op import PluggableLayer
from minivllm.model_executor.layers.attention.mla_attention import MLAAttention
from minivllm.model_executor.layers.quantization import QuantizationConfig


@dataclass
class MLAModules:
    """The projections and norms of one MLA block (vLLM's field names)."""

    kv_a_layernorm: torch.nn.Module
    kv_b_proj: torch.nn.Module
    rotary_emb: torch.nn.Module | None
    o_proj: torch.nn.Module
    fused_qkv_a_proj: torch.nn.Module | None
    kv_a_proj_with_mqa: torch.nn.Module | None
    q_a_layernorm: torch.nn.Module | None
    q_b_proj: torch.nn.Module | None
    q_proj: torch.nn.Module | None
    indexer: torch.nn.Module | None
    is_sparse: bool
    topk_indices_buffer: torch.Tensor | None
    indexer_rotary_emb: torch.nn.Module | None = None
    g_proj: torch.nn.Module | None = None
    index_group_builder: Any = None


@PluggableLayer.register("multi_head_latent_attention")
class MultiHeadLatentAttentionWrapper(PluggableLayer):
    """MLA block: positions [T], hidden [T, H] -> [T, H] (o_proj all-reduced over TP)."""

    # Built with the attention block's prefix; its MLAAttention registers as `<prefix>.attn`.
    records_parent_prefix = True
    prefix_renamed_children = {"mla_attn": "attn"}

    def __init__(self, hidden_size: int, num_heads: int, scale: float, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None,
                 kv_lora_rank: int, mla_modules: MLAModules,
                 cache_config: CacheConfig | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 **unused: Any) -> None:
        super().__init__()
        m = mla_modules
        needed = (["fused_qkv_a_proj", "q_a_layernorm", "q_b_proj"] if q_lora_rank is not None
                  else ["kv_a_proj_with_mqa", "q_proj"])
        missing = [name for name in needed if getattr(m, name) is None]
        if missing:
            raise ValueError(f"MLA with q_lora_rank={q_lora_rank} needs MLAModules fields "
                             f"{missing}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim, self.q_lora_rank, self.kv_lora_rank = v_head_dim, q_lora_rank, kv_lora_rank
        self.fused_qkv_a_proj, self.kv_a_proj_with_mqa = m.fused_qkv_a_proj, m.kv_a_proj_with_mqa
        self.q_a_layernorm, self.q_b_proj, self.q_proj = m.q_a_layernorm, m.q_b_proj, m.q_proj
        self.kv_a_layernorm, self.kv_b_proj = m.kv_a_layernorm, m.kv_b_proj
        self.rotary_emb, self.o_proj, self.g_proj = m.rotary_emb, m.o_proj, m.g_proj
        self.indexer, self.is_sparse = m.indexer, m.is_sparse
        self.mla_attn = MLAAttention(
            num_heads=num_heads, scale=scale, qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, q_lora_rank=q_lora_rank,
            kv_lora_rank=kv_lora_rank, kv_b_proj=m.kv_b_proj, cache_config=cache_config,
            quant_config=quant_config, prefix=f"{prefix}.attn", use_sparse=m.is_sparse,
            indexer=m.indexer)
        self.prefix = prefix

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor:
        if self.q_lora_rank is not None:
            # One GEMM for both down-projections: [T, q_lora_rank + L + R].
            qkv_a = self.fused_qkv_a_proj(hidden_states)[0]
            q_a, kv_a = qkv_a.split([self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim],
                                    dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))[0]
        else:
            kv_a = self.kv_a_proj_with_mqa(hidden_states)[0]    # [T, L + R]
            q = self.q_proj(hidden_states)[0]
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c)                 # [T, L]
        q = q.view(-1, self.num_heads, self.qk_head_dim)        # [T, nH, Dn + R]
        k_pe = k_pe.unsqueeze(1)                                # [T, 1, R]: one shared head
        if self.rotary_emb is not None:
            q_pe, k_pe = self.rotary_emb(positions, q[..., self.qk_nope_head_dim:], k_pe)
            q = torch.cat((q[..., :self.qk_nope_head_dim], q_pe), dim=-1)
        if llama_4_scaling is not None:                         # [T, 1, 1] position scaling
            q = q * llama_4_scaling
        attn_out = self.mla_attn(q, kv_c_normed, k_pe,
                                 output_shape=(hidden_states.shape[0],
                                               self.num_heads * self.v_head_dim))
        if self.g_proj is not None:                             # output gate (some variants)
            attn_out = attn_out * self.g_proj(hidden_states)[0].sigmoid()
        return self.o_proj(attn_out)[0]


__all__ = ["MLAModules", "MultiHeadLatentAttentionWrapper"]
