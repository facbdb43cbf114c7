"""Gemma: Llama's stack with `(1 + w)` RMSNorms, GELU-gated MLPs, embeddings scaled by sqrt(hidden)
and tied LM heads. `GemmaAttention` also carries what Gemma 2 and 3 add (soft cap, query scalar,
per-layer windows and RoPE, QK-norm), so gemma2.py and gemma3.py reuse it."""

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import CacheConfig, VllmConfig
from minivllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from minivllm.model_executor.layers.activation import GeluAndMul
from minivllm.model_executor.layers.attention import Attention
from minivllm.model_executor.layers.layernorm import GemmaRMSNorm
from minivllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope

from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

if TYPE_CHECKING:     # annotations only: transformers is slow to import
    from transformers import GemmaConfig

# HF activation names -> GeluAndMul's `approximate` (transformers' own meaning of each name).
_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu_new": "tanh",
                        "gelu_fast": "tanh", "gelu": "none"}


def gemma_activation(config: Any) -> str:
    """GeluAndMul's `approximate` for `hidden_activation` (Gemma 2/3) or `hidden_act` (Gemma 1)."""
    field = "hidden_activation" if getattr(config, "hidden_activation", None) else "hidden_act"
    name = getattr(config, field)
    if name not in _GELU_APPROXIMATIONS:
        raise ValueError(f"Unsupported {field}={name!r} for Gemma; supported: "
                         f"{', '.join(_GELU_APPROXIMATIONS)}")
    return _GELU_APPROXIMATIONS[name]


class GemmaMLP(LlamaMLP):
    """gate_up -> GELU(gate) * up -> down; Llama's layers and names, Gemma's activation."""

    def __init__(self, hidden_size: int, intermediate_size: int, approximate: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(hidden_size, intermediate_size, "silu", quant_config=quant_config,
                         prefix=prefix)
        self.act_fn = GeluAndMul(approximate=approximate)


class GemmaAttention(nn.Module):
    """QKV -> [QK-norm] -> RoPE -> attention (scaled, soft-capped, windowed) -> o_proj.

    q `[T, nH*d]`, k/v `[T, nKV*d]` for this TP rank's heads; d is `config.head_dim`, which need
    not be hidden / heads."""

    def __init__(self, config: "GemmaConfig", hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, max_position_embeddings: int, rope_parameters: dict | None,
                 scaling: float, logits_soft_cap: float | None = None,
                 sliding_window: int | None = None, qk_norm: bool = False,
                 cache_config: CacheConfig | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        assert num_heads % tp_size == 0
        # KV heads are split when there are at least TP of them, otherwise replicated.
        assert (num_kv_heads % tp_size == 0 if num_kv_heads >= tp_size
                else tp_size % num_kv_heads == 0)
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        if qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary_emb = get_rope(head_dim, max_position=max_position_embeddings,
                                   rope_parameters=rope_parameters, is_neox_style=True)
        self.attn = Attention(self.num_heads, head_dim, scaling, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config,
                              logits_soft_cap=logits_soft_cap,
                              per_layer_sliding_window=sliding_window, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:                                   # per head: via [T, heads, d]
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(q.shape)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))        # [T, q_size] -> [T, H]
        return output


def gemma_attention(vllm_config: VllmConfig, prefix: str, **features: Any) -> GemmaAttention:
    """The layer's attention with the config's geometry; `features` as GemmaAttention's."""
    config = vllm_config.model_config.hf_config
    features.setdefault("rope_parameters", getattr(config, "rope_parameters", None))
    features.setdefault("scaling", config.head_dim**-0.5)
    return GemmaAttention(config, config.hidden_size, config.num_attention_heads,
                          config.num_key_value_heads, config.head_dim,
                          config.max_position_embeddings, cache_config=vllm_config.cache_config,
                          quant_config=vllm_config.quant_config, prefix=f"{prefix}.self_attn",
                          **features)


def gemma_mlp(vllm_config: VllmConfig, prefix: str) -> GemmaMLP:
    config = vllm_config.model_config.hf_config
    return GemmaMLP(config.hidden_size, config.intermediate_size, gemma_activation(config),
                    quant_config=vllm_config.quant_config, prefix=f"{prefix}.mlp")


class GemmaDecoderLayer(nn.Module):
    """Pre-norm block (attention, then MLP), the residual stream outside the norms."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = gemma_attention(vllm_config, prefix)
        self.mlp = gemma_mlp(vllm_config, prefix)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # The same data flow as Llama's block; only the modules differ.
    forward = LlamaDecoderLayer.forward


@support_torch_compile
class GemmaModel(LlamaModel):
    """Llama's model loop; the embedding output is scaled by sqrt(hidden), the final norm is
    Gemma's.

    NOTE: the scale is applied in `embed_input_ids`, so `inputs_embeds` given to `forward` are
    taken as already scaled (text-only models never pass them unscaled)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = GemmaDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        config = vllm_config.model_config.hf_config
        if get_pp_group().is_last_rank:
            self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # transformers rounds sqrt(hidden) to the activation dtype before multiplying.
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)                  # [T, H]
        return embeds * self.normalizer.to(embeds.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma with its (tied) LM head; LoRA, PP and quantization as Llama."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = GemmaDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = GemmaDecoderLayer) -> nn.Module:
        return GemmaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


__all__ = ["GemmaAttention", "GemmaDecoderLayer", "GemmaForCausalLM", "GemmaMLP", "GemmaModel",
           "gemma_activation", "gemma_attention", "gemma_mlp"]
