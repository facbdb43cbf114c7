"""Cohere Command-R / R+ (`CohereForCausalLM`) and Command R7B (`Cohere2ForCausalLM`).

Parallel blocks `x + attn(ln(x)) + mlp(ln(x))` with one weight-only LayerNorm, GPT-J-style
(interleaved) RoPE, logits times `logit_scale`, tied embeddings. `use_qk_norm` (R+) adds a
weight-only LayerNorm per head on q and k; Cohere2 interleaves sliding-window layers (with
RoPE) and full-attention layers (without positions), from `layer_types`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import VllmConfig
from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
# NOTE: imported under another name: `LayerNorm` here is vLLM's commandr class (below), which
# vLLM's other Cohere files (cohere2_moe.py, cohere_eagle.py) import from this module.
from minivllm.model_executor.layers.layernorm import LayerNorm as FusedAddLayerNorm
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope
from minivllm.model_executor.parameter import (default_weight_loader, set_weight_attrs,
                                               sharded_weight_loader)

from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, input_norm
from .utils import PPMissingLayer, extract_layer_index


class LayerNorm(nn.Module):
    """vLLM's `commandr.LayerNorm`: Cohere's weight-only LayerNorm over the last dim, in fp32,
    weight of `param_shape` ([hidden] or [heads, head_dim]; a 2-D one is split over TP by rows).
    `forward(x, residuals)` returns `(norm(x), residuals)`: the residual passes through
    untouched, its caller adds it (unlike `FusedAddLayerNorm(x, residual)`)."""

    def __init__(self, param_shape: int | tuple[int, ...] | None = None,
                 eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(param_shape), requires_grad=False)
        self.variance_epsilon = eps
        loader = sharded_weight_loader(0) if self.weight.dim() == 2 else default_weight_loader
        set_weight_attrs(self.weight, {"weight_loader": loader})

    def forward(self, hidden_states: torch.Tensor, residuals: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        normed = F.layer_norm(hidden_states.float(), (hidden_states.shape[-1],),
                              eps=self.variance_epsilon) * self.weight.float()
        return normed.to(hidden_states.dtype), residuals


def local_head_starts(attn: LlamaAttention) -> tuple[int, int]:
    """Global index of this TP rank's first q head and first KV head (QKVParallelLinear's split:
    with fewer KV heads than ranks each is replicated, rank r holding head r // replicas)."""
    rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    kv_first = (rank * attn.num_kv_heads if attn.total_num_kv_heads >= tp_size
                else rank // (tp_size // attn.total_num_kv_heads))
    return rank * attn.num_heads, kv_first


class LayerNormPerHead(nn.Module):
    """A weight-only LayerNorm over each head of `[T, heads * head_dim]`, for this rank's heads.

    The weight is `[heads, head_dim]`; its loader keeps this rank's rows of the checkpoint's
    `[total_heads, head_dim]` tensor.
    """

    def __init__(self, head_dim: int, num_heads: int, first_head: int, eps: float) -> None:
        super().__init__()
        self.head_dim, self.num_heads, self.first_head, self.eps = (head_dim, num_heads,
                                                                    first_head, eps)
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim, dtype=torch.float32),
                                   requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self._load_heads})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.view(*x.shape[:-1], self.num_heads, self.head_dim)   # [T, heads, d]
        normed = F.layer_norm(heads.float(), (self.head_dim,), eps=self.eps) * self.weight
        return normed.to(x.dtype).view(x.shape)

    def _load_heads(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        rows = loaded_weight.narrow(0, self.first_head, self.num_heads)
        assert rows.shape == param.shape, f"{tuple(loaded_weight.shape)} -> {tuple(param.shape)}"
        param.data.copy_(rows)


class CohereAttention(LlamaAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs["config"]
        layer_types = getattr(config, "layer_types", None)
        # Cohere2: only the sliding-window layers rotate; the global ones see no positions.
        self.use_rope = (not layer_types or
                         layer_types[extract_layer_index(kwargs["prefix"])] == "sliding_attention")
        self.use_qk_norm = getattr(config, "use_qk_norm", False)
        if self.use_qk_norm:
            q_first, kv_first = local_head_starts(self)
            eps = config.layer_norm_eps
            self.q_norm = LayerNormPerHead(self.head_dim, self.num_heads, q_first, eps)
            self.k_norm = LayerNormPerHead(self.head_dim, self.num_kv_heads, kv_first, eps)

    def _init_rotary_emb(self, config, quant_config: QuantizationConfig | None) -> None:
        self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None),
                                   is_neox_style=False)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))        # [T, H]
        return output


class CohereDecoderLayer(nn.Module):
    """Parallel block in the Llama layer protocol: the branch sum leaves un-added, and the next
    layer (or the final norm) adds the residual."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        bias = getattr(config, "attention_bias", False)
        self.self_attn = CohereAttention(
            config=config, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings, quant_config=quant_config,
            bias=bias, bias_o_proj=bias, cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = FusedAddLayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                                 has_bias=False)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        attn = self.self_attn(positions=positions, hidden_states=hidden_states)
        return attn + self.mlp(hidden_states), residual


class CohereModel(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = CohereDecoderLayer) -> None:
        config = vllm_config.model_config.hf_config
        # NOTE: LlamaModel builds its final RMSNorm from `rms_norm_eps`, which Cohere configs
        # lack; that norm is replaced by Cohere's LayerNorm right after.
        if not hasattr(config, "rms_norm_eps"):
            config.rms_norm_eps = config.layer_norm_eps
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        if not isinstance(self.norm, PPMissingLayer):     # the last PP stage holds the norm
            self.norm = FusedAddLayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                          has_bias=False)


class CohereForCausalLM(LlamaForCausalLM):
    # LlamaForCausalLM's LogitsProcessor already multiplies by `config.logit_scale`.
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = CohereDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = CohereDecoderLayer) -> nn.Module:
        return CohereModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
