"""EXAONE 4.0: post-norm blocks, a per-head RMS QK-norm, and hybrid attention on the Llama classes.

A block is `h = x + norm_a(attn(x)); out = h + norm_m(mlp(h))` (no input norm, as OLMo 2), but
the q / k norms act on each head's `head_dim` (as Qwen3), so TP needs no gather. Hybrid models
mix sliding-window layers with global ones (`layer_types`, derived by transformers from
`sliding_window_pattern`); there the global layers are position-free (NoPE) and only the
sliding ones rotate. Without a sliding window every layer rotates.
"""

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope

from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from .olmo2 import Olmo2DecoderLayer
from .qwen3 import apply_qk_norm

if TYPE_CHECKING:     # annotations only: transformers is slow to import
    from transformers import Exaone4Config


def layer_uses_rope(config: "Exaone4Config", layer_idx: int) -> bool:
    """transformers' rule: RoPE everywhere without a sliding window, else on sliding layers only
    (the global layers of a hybrid model see no positions)."""
    if getattr(config, "sliding_window", None) is None:
        return True
    layer_types = getattr(config, "layer_types", None) or []
    return layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"


class Exaone4Attention(LlamaAttention):
    """Llama attention with a per-head q / k RMSNorm before RoPE, and no RoPE on NoPE layers.
    The sliding window of `sliding_attention` layers is set by LlamaAttention."""

    def __init__(self, config: "Exaone4Config", *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _init_rotary_emb(self, config: "Exaone4Config",
                         quant_config: QuantizationConfig | None) -> None:
        # NOTE: LlamaAttention sets `layer_idx` (from the prefix) before calling this hook.
        if not layer_uses_rope(config, self.layer_idx):
            self.rotary_emb = None
            return
        self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None),
                                   is_neox_style=True)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = apply_qk_norm(q, k, self.q_norm, self.k_norm, self.head_dim)
        if self.rotary_emb is not None:                    # None: a global (NoPE) layer
            q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))        # [T, H]
        return output


class Exaone4DecoderLayer(nn.Module):
    """Post-norm block in the Llama layer protocol `(hidden, residual) -> (hidden, residual)`:
    the MLP branch leaves un-added, and the next layer (or the final fused add + norm) adds it."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.self_attn = Exaone4Attention(
            config=config, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            max_position_embeddings=config.max_position_embeddings, quant_config=quant_config,
            bias=False, cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # OLMo 2's post-norm block: the same attributes, the same order.
    forward = Olmo2DecoderLayer.forward


class Exaone4Model(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Exaone4DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4.0 with an LM head (tied or not, per the config); LoRA and PP as Llama."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Exaone4DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Exaone4DecoderLayer) -> nn.Module:
        return Exaone4Model(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


__all__ = ["Exaone4Attention", "Exaone4DecoderLayer", "Exaone4ForCausalLM", "Exaone4Model",
           "layer_uses_rope"]
