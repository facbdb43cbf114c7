"""`BailingMoELinearAttention`: Ling / Ring 2.5's (BailingMoeV2.5) lightning-attention layer,
a recurrent-state layer.

    q, k, v = query_key_value(h)                     fp32 from here; silu first if linear_silu
    q, k = rms_norm(q), rms_norm(k) per head         if use_qk_norm
    q, k = rope(q, k)                                neox style, partial_rotary_factor of d
    o = lightning_attention(q d^-1/2, k, v)          per-head decay slopes, `linear/base.py`
    out = dense(group_rms_norm(o) * w * sigmoid(g_proj(h)))

The state and the varlen attention are `linear/base.py`'s. Tensor parallelism splits the heads;
the gated norm normalises groups of hidden_inner / group_norm_size channels, which a TP rank
holds whole (group_norm_size a multiple of the TP size).
"""

import copy

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from minivllm.config import VllmConfig
from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
from minivllm.model_executor.layers.layernorm import RMSNorm, RMSNormGated, rms_norm
from minivllm.model_executor.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)
from minivllm.model_executor.layers.mamba.linear.base import LinearAttention
# vLLM's module exposes these helpers under its own name too; files import them from here.
from minivllm.model_executor.layers.mamba.linear.minimax_linear_attn import (  # noqa: F401
    MiniMaxText01LinearAttention, MiniMaxText01LinearKernel,
    clear_linear_attention_cache_for_new_sequences, linear_attention_decode,
    linear_attention_prefill_and_mix)
from minivllm.model_executor.layers.rotary_embedding import get_rope
from minivllm.v1.attention.backends.linear_attn import BailingLinearAttentionBackend


def _build_rope_parameters(config: PretrainedConfig) -> dict | None:
    """The config's RoPE fields as one `rope_parameters` dict: rope_theta and
    partial_rotary_factor where only top-level, a legacy rope_scaling ("type" -> "rope_type")
    on top. None when the config names none."""
    params = copy.deepcopy(getattr(config, "rope_parameters", None)) or {}
    for name in ("rope_theta", "partial_rotary_factor"):
        if name not in params and hasattr(config, name):
            params[name] = getattr(config, name)
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        params.update(scaling)
    return params or None


class BailingGroupRMSNormGate(RMSNormGated):
    """rms_norm per group of channels * w * sigmoid(gate); the weight is split over TP."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps=eps, group_size=group_size,
                         norm_before_gate=norm_before_gate, device=device, dtype=dtype,
                         activation="sigmoid")
        self.weight.weight_loader = self._weight_loader

    @staticmethod
    def _weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's contiguous share of the full [hidden_inner] weight."""
        shard = loaded_weight.shape[0] // get_tensor_model_parallel_world_size()
        start = get_tensor_model_parallel_rank() * shard
        param.data.copy_(loaded_weight[start:start + shard])


class BailingMoELinearAttention(LinearAttention):
    """hidden [T, hidden_size] -> output [T, hidden_size], written into `output` (vLLM's
    calling convention; dense is all-reduced over TP)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig,
                 prefix: str = "linear_attn") -> None:
        super().__init__(config, vllm_config, prefix)
        self.scaling = self.head_dim ** -0.5
        self.max_position_embeddings = config.max_position_embeddings
        self.q_size_per_rank = self.kv_size_per_rank = self.head_dim * self.tp_heads
        self.use_qk_norm = getattr(config, "use_qk_norm", False)
        self.linear_rope = getattr(config, "linear_rope", True)
        self.linear_silu = getattr(config, "use_linear_silu", getattr(config, "linear_silu",
                                                                      False))
        self.rms_norm_eps = float(getattr(config, "rms_norm_eps", 1e-5))
        quant = self.quant_config
        self.query_key_value = QKVParallelLinear(
            self.hidden_size, self.head_dim, self.num_heads, self.num_heads,
            bias=config.use_bias or config.use_qkv_bias, quant_config=quant,
            prefix=f"{prefix}.query_key_value")
        if self.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.g_proj = ColumnParallelLinear(self.hidden_size, self.hidden_inner_size, bias=False,
                                           quant_config=quant, prefix=f"{prefix}.g_proj")
        self.dense = RowParallelLinear(self.hidden_inner_size, self.hidden_size,
                                       bias=config.use_bias, quant_config=quant,
                                       prefix=f"{prefix}.dense", reduce_results=True)
        self.group_norm_size = getattr(config, "group_norm_size", 1)
        if self.group_norm_size % self.tp_size:
            raise ValueError(f"group_norm_size ({self.group_norm_size}) must be a multiple of "
                             f"the tensor parallel size ({self.tp_size})")
        local_inner = self.hidden_inner_size // self.tp_size
        self.g_norm = BailingGroupRMSNormGate(
            local_inner, eps=self.rms_norm_eps,
            group_size=self.hidden_inner_size // self.group_norm_size
            if self.group_norm_size > 1 else local_inner)
        # fp32 tables: q and k are rotated in fp32 whatever the model's dtype.
        self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                   is_neox_style=True,
                                   rope_parameters=_build_rope_parameters(config),
                                   dtype=torch.float32)
        self.init_slopes()
        self.register_states(vllm_config)

    def get_attn_backend(self) -> type[BailingLinearAttentionBackend]:
        return BailingLinearAttentionBackend

    def forward(self, hidden_states: torch.Tensor, output: torch.Tensor,
                positions: torch.Tensor) -> None:
        output[:hidden_states.shape[0]] = self._forward(hidden_states, positions)

    def _forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self._project_qkv(hidden_states, positions)
        hidden = self.linear_attention(q, k, v)                        # [T, h/tp * d] fp32
        gate, _ = self.g_proj(hidden_states)
        # One gated-norm call covers both of vLLM's branches: with one group the norm is over
        # the rank's whole width and the sigmoid gate multiplies after it either way.
        hidden = self.g_norm(hidden, gate).to(hidden_states.dtype)
        out, _ = self.dense(hidden.view(num_tokens, -1))
        return out

    def _project_qkv(self, hidden_states: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q (scaled), k, v [T, heads/tp, d] fp32."""
        qkv, _ = self.query_key_value(hidden_states)
        qkv = qkv.float()
        if self.linear_silu:
            qkv = F.silu(qkv)
        q, k, v = qkv.split([self.q_size_per_rank, self.kv_size_per_rank,
                             self.kv_size_per_rank], dim=-1)
        shape = (qkv.shape[0], self.tp_heads, self.head_dim)
        if self.use_qk_norm:                                            # per head, fp32
            q = rms_norm(q.reshape(shape), self.query_layernorm.weight.float(),
                         self.rms_norm_eps).reshape(q.shape)
            k = rms_norm(k.reshape(shape), self.key_layernorm.weight.float(),
                         self.rms_norm_eps).reshape(k.shape)
        if self.linear_rope:
            q, k = self.rotary_emb(positions, q, k)
        return q.reshape(shape) * self.scaling, k.reshape(shape), v.reshape(shape)
