"""OLMo 2 and OLMo 3: post-norm blocks and an RMS QK-norm over all heads, on the Llama classes.

A block is `h = x + norm_a(attn(x)); out = h + norm_m(mlp(h))` (no input norm). The q / k norms
span every head (`[num_heads * head_dim]`), so under TP the projections are gathered, normed and
split again. OLMo 3 adds sliding-window layers (`layer_types`, handled by Llama's attention)
and RoPE parameters per layer type (`rope_parameters[layer_type]`, as transformers nests them).
"""

from functools import partial

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_gather)
from minivllm.distributed.utils import split_tensor_along_last_dim
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope

from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from .utils import extract_layer_index


class Olmo2Attention(LlamaAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs["config"]
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.q_norm = RMSNorm(self.total_num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.total_num_kv_heads * self.head_dim, eps=config.rms_norm_eps)

    def _init_rotary_emb(self, config, quant_config: QuantizationConfig | None) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            # NOTE: LlamaAttention builds qkv_proj (whose prefix names the layer) before this hook.
            layer_type = layer_types[extract_layer_index(self.qkv_proj.prefix)]
            params = params.get(layer_type, params)
        self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                   rope_parameters=params or None, is_neox_style=True)

    def _apply_qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp_size > 1:                      # the norm needs every head: [T, nH * d]
            q = tensor_model_parallel_all_gather(q.contiguous())
            k = tensor_model_parallel_all_gather(k.contiguous())
        q, k = self.q_norm(q), self.k_norm(k)
        if self.tp_size > 1:                      # back to this rank's heads
            split = partial(split_tensor_along_last_dim, num_partitions=self.tp_size)
            q, k = split(q)[self.tp_rank], split(k)[self.tp_rank]
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._apply_qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))        # [T, H]
        return output


class Olmo2DecoderLayer(nn.Module):
    """Post-norm block in the Llama layer protocol `(hidden, residual) -> (hidden, residual)`:
    the MLP branch leaves un-added, and the next layer (or the final fused add + norm) adds it."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.self_attn = Olmo2Attention(
            config=config, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            max_position_embeddings=config.max_position_embeddings, quant_config=quant_config,
            bias=getattr(config, "attention_bias", False), cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:                  # the previous block's MLP branch joins here
            hidden_states = hidden_states + residual
        attn = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        residual = hidden_states + attn           # [T, H]
        mlp = self.post_feedforward_layernorm(self.mlp(residual))
        return mlp, residual


class Olmo2Model(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Olmo2DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Olmo2ForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Olmo2DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Olmo2DecoderLayer) -> nn.Module:
        return Olmo2Model(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
