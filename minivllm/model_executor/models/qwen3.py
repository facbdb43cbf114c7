"""Qwen3: Qwen2's stack with a per-head RMSNorm on q and k (before RoPE) and a config `head_dim`."""

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig
from minivllm.model_executor.layers.layernorm import RMSNorm

from .llama import LlamaAttention, LlamaDecoderLayer
from .qwen2 import Qwen2ForCausalLM, Qwen2MLP as Qwen3MLP, Qwen2Model

if TYPE_CHECKING:     # annotations only: transformers is slow to import
    from transformers import Qwen3Config


class Qwen3Attention(LlamaAttention):
    """Llama attention plus QK-norm: RMSNorm over each head's `head_dim` of q and k.

    The q/k/v and o_proj biases follow `attention_bias` (the decoder layer passes it), as in
    transformers' Qwen3.
    """

    def __init__(self, config: "Qwen3Config", *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = apply_qk_norm(q, k, self.q_norm, self.k_norm, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)                   # [T, q_size]
        output, _ = self.o_proj(attn_output)               # [T, H]
        return output


def apply_qk_norm(q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm every head of q `[T, nH*d]` and k `[T, nKV*d]` on its own; same shapes out.

    NOTE: via `[T, heads, d]` views of the qkv output, which the native bf16 norm reads in
    place: no copy of q or k, so decode steps of any batch size stay all native (CPU graphs)."""
    q = q_norm(q.view(q.shape[0], -1, head_dim)).reshape(q.shape)   # via [T, nH, d]
    k = k_norm(k.view(k.shape[0], -1, head_dim)).reshape(k.shape)   # via [T, nKV, d]
    return q, k


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with Qwen3's attention."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "",
                 config: "Qwen3Config | None" = None,
                 attn_layer_type: type[nn.Module] = Qwen3Attention) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1,
                                         "intermediate_tensors": 0, "inputs_embeds": 0})
class Qwen3Model(Qwen2Model):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 decoder_layer_type: type[nn.Module] = Qwen3DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         decoder_layer_type=decoder_layer_type)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen3 with an LM head; LoRA, PP and EAGLE-3 as Llama."""

    hf_to_vllm_mapper = Qwen3Model.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Qwen3DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Qwen3DecoderLayer) -> nn.Module:
        return Qwen3Model(vllm_config=vllm_config, prefix=prefix, decoder_layer_type=layer_type)


__all__ = ["Qwen3Attention", "Qwen3DecoderLayer", "Qwen3ForCausalLM", "Qwen3MLP", "Qwen3Model",
           "apply_qk_norm"]
