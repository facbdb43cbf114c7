"""GLM-4 (GLM-4-0414 family): "sandwich" norms and GPT-J-style partial rotary, on Llama parts.

Each block norms its input and also each branch's output (`post_self_attn_layernorm`,
`post_mlp_layernorm`); RoPE rotates interleaved pairs of the first `partial_rotary_factor` of
each head; q/k/v carry a bias, o_proj none; gate/up come fused in the checkpoint.
"""

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope

from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, input_norm


class Glm4Attention(LlamaAttention):
    def _init_rotary_emb(self, config, quant_config: QuantizationConfig | None) -> None:
        self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None),
                                   is_neox_style=False)


class Glm4DecoderLayer(nn.Module):
    """Llama's pre-norm block with a norm on each branch's output as well (GLM-4 v1's block,
    `glm.py`, is the same without those two: `sandwich_norms = False`)."""

    sandwich_norms = True

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.self_attn = Glm4Attention(
            config=config, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings, quant_config=quant_config,
            bias=getattr(config, "attention_bias", True), bias_o_proj=False,
            cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=quant_config, prefix=f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        if self.sandwich_norms:
            self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps=eps)
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        attn = self.self_attn(positions, hidden_states)
        if self.sandwich_norms:
            attn = self.post_self_attn_layernorm(attn)
        hidden_states, residual = self.post_attention_layernorm(attn, residual)
        mlp = self.mlp(hidden_states)
        return (self.post_mlp_layernorm(mlp) if self.sandwich_norms else mlp), residual


class Glm4Model(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Glm4DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Glm4ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Glm4DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Glm4DecoderLayer) -> nn.Module:
        return Glm4Model(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
