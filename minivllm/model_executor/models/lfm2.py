"""LFM2 (Liquid AI's LFM2 / LFM2.5, 350M-2.6B): a hybrid of gated short-convolution layers and
grouped-query attention layers with per-head QK RMSNorm, each followed by a SwiGLU MLP.

`config.layer_types` names each layer "conv" (a `ShortConv`, whose state is the last
`conv_L_cache - 1` inputs of each sequence) or "full_attention". Norms are pre-norms
(`operator_norm`, `ffn_norm`) and the final one is named `embedding_norm`; the LM head is tied.
"""

from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.mamba import ShortConv

from .interfaces import IsHybrid
from .llama import LlamaAttention, LlamaForCausalLM, LlamaModel, input_norm
from .utils import WeightsMapper, extract_layer_index


def lfm2_intermediate_size(config: Any) -> int:
    """The MLP width LFM2 derives from its config (2/3 of it, times a multiplier, rounded up to
    `block_multiple_of`) when `block_auto_adjust_ff_dim` is set."""
    size = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            multiple = config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def lfm2_layer_types(config: Any) -> list[str]:
    """Per layer "conv" or "full_attention" (older configs list the attention layers only)."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    attention = set(config.full_attn_idxs)
    return ["full_attention" if i in attention else "conv"
            for i in range(config.num_hidden_layers)]


class Lfm2MLP(nn.Module):
    """w1 / w3 (merged as w13) -> SiLU(w1 x) * w3 x -> w2."""

    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        size = lfm2_intermediate_size(config)
        self.w13 = MergedColumnParallelLinear(config.hidden_size, [size] * 2, bias=False,
                                              quant_config=quant_config, prefix=f"{prefix}.w13")
        self.w2 = RowParallelLinear(size, config.hidden_size, bias=False,
                                    quant_config=quant_config, prefix=f"{prefix}.w2")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.w13(x)
        x, _ = self.w2(self.act_fn(x))
        return x


class Lfm2Attention(LlamaAttention):
    """Llama's attention with RMSNorm over each head's q and k (before RoPE); `out_proj`."""

    def __init__(self, config: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(config=config, hidden_size=config.hidden_size,
                         num_heads=config.num_attention_heads,
                         num_kv_heads=config.num_key_value_heads,
                         max_position_embeddings=config.max_position_embeddings,
                         prefix=prefix, **kwargs)
        del self.o_proj                                 # the checkpoint calls it out_proj
        self.out_proj = RowParallelLinear(self.total_num_heads * self.head_dim,
                                          config.hidden_size, bias=False,
                                          quant_config=kwargs.get("quant_config"),
                                          prefix=f"{prefix}.out_proj")
        self.q_layernorm = RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, eps=config.norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_layernorm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_layernorm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.out_proj(self.attn(q, k, v))
        return output


class Lfm2DecoderLayer(nn.Module):
    """operator_norm -> conv or attention -> ffn_norm -> MLP (the residual outside the norms)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        layer_idx = extract_layer_index(prefix)
        self.is_attention_layer = lfm2_layer_types(config)[layer_idx] != "conv"
        if self.is_attention_layer:
            self.self_attn = Lfm2Attention(config, prefix=f"{prefix}.self_attn",
                                           quant_config=quant_config,
                                           cache_config=vllm_config.cache_config)
        else:
            self.conv = ShortConv(config, config.hidden_size, layer_idx,
                                  quant_config=quant_config, prefix=f"{prefix}.conv")
        self.feed_forward = Lfm2MLP(config, quant_config, prefix=f"{prefix}.feed_forward")
        self.operator_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.operator_norm, hidden_states, residual)
        if self.is_attention_layer:
            hidden_states = self.self_attn(positions, hidden_states)
        else:
            hidden_states = self.conv(hidden_states)
        hidden_states, residual = self.ffn_norm(hidden_states, residual)
        return self.feed_forward(hidden_states), residual


class Lfm2Model(LlamaModel):
    """Llama's model body on LFM2's layers; the checkpoint's final `embedding_norm` is `norm`."""

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_substr={"embedding_norm.": "norm."},
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"), ".feed_forward.w1.": (".feed_forward.w13.", 0),
            ".feed_forward.w3.": (".feed_forward.w13.", 1)})
    # NOTE: conv.in_proj is one [3H, H] checkpoint matrix (B, C and x row blocks): the merged
    # layer's loader splits it into its three shards.

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Lfm2DecoderLayer) -> None:
        config = vllm_config.model_config.hf_config
        config.rms_norm_eps = config.norm_eps           # what Llama's final norm reads
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Lfm2ForCausalLM(LlamaForCausalLM, IsHybrid):
    """LFM2 with its tied LM head; PP, LoRA, quantization and EAGLE-3 hooks as Llama."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "w13": ["w1", "w3"], "in_proj": ["in_proj"]}
    hf_to_vllm_mapper = Lfm2Model.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=Lfm2DecoderLayer)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Lfm2DecoderLayer) -> nn.Module:
        return Lfm2Model(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


__all__ = ["Lfm2ForCausalLM", "Lfm2Model", "lfm2_intermediate_size", "lfm2_layer_types"]
