"""Swiss AI Apertus: Llama attention with an RMSNorm per head on q and k, and a non-gated xIELU
MLP (`down(xielu(up(x)))`, Arcee's MLP with another activation).

The block is Llama's pre-norm block with the norms renamed `attention_layernorm` and
`feedforward_layernorm`. The q / k norms act on each head (`[head_dim]` weights) before RoPE,
so they need no communication under TP. xIELU keeps learned `alpha_p` / `alpha_n` per layer
(`mlp.act_fn.*` in the checkpoint). RoPE defaults to Llama 3 scaling (transformers' config).
"""

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.layernorm import RMSNorm

from .arcee import QKV_ONLY_MAPPER, ArceeMLP, make_attention
from .llama import LlamaAttention, LlamaForCausalLM, LlamaModel, input_norm


class ApertusMLP(ArceeMLP):
    """up -> xIELU -> down; Apertus checkpoints use no other activation (as vLLM checks)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 *args, **kwargs) -> None:
        if hidden_act != "xielu":
            raise ValueError(f"Unsupported activation: {hidden_act} (config field hidden_act); "
                             "Apertus supports xielu only")
        super().__init__(hidden_size, intermediate_size, hidden_act, *args, **kwargs)


class ApertusAttention(LlamaAttention):
    """Llama attention with `q_norm` / `k_norm` ([head_dim] weights) applied to every head."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Norm each head: [T, heads / TP, head_dim], then back to [T, heads / TP * head_dim].
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(q.shape)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))        # [T, H]
        return output


class ApertusDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        super().__init__()
        config = config or vllm_config.model_config.hf_config
        self.self_attn = make_attention(vllm_config, config, prefix, ApertusAttention)
        self.mlp = ApertusMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                              quant_config=vllm_config.quant_config,
                              bias=getattr(config, "mlp_bias", False), prefix=f"{prefix}.mlp")
        self.attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.attention_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.feedforward_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class ApertusModel(LlamaModel):
    hf_to_vllm_mapper = QKV_ONLY_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = ApertusDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class ApertusForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    hf_to_vllm_mapper = QKV_ONLY_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = ApertusDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = ApertusDecoderLayer) -> nn.Module:
        return ApertusModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
