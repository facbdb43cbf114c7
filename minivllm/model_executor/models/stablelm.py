"""StableLM (StableLM 2, StableLM-3B-4E1T, ...): LayerNorm blocks, partial rotary, on Llama parts.

Llama's attention (q/k/v bias from `use_qkv_bias`, no o_proj bias) and MLP; norms are
LayerNorms with bias. `use_parallel_residual` gives `x + attn(ln(x)) + mlp(ln(x))` with one
norm; `qk_layernorm` a weight-only LayerNorm per head on q and k before RoPE (StableLM 2 12B).
"""

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.layernorm import LayerNorm
from minivllm.model_executor.models.auto_weights_loader import UnexpectedWeightsError

from .commandr import LayerNormPerHead, local_head_starts
from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, input_norm
from .utils import PPMissingLayer


def _norm_eps(config) -> float:
    return getattr(config, "norm_eps", None) or getattr(config, "layer_norm_eps", 1e-5)


class StablelmLayerNormPerHead(LayerNormPerHead):
    """`LayerNormPerHead` loaded from one `norms.<h>.weight` per head (global index h)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        filled, unexpected = set(), []
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "norms" or parts[2] != "weight" \
                    or not parts[1].isdigit():
                unexpected.append(name)
                continue
            row = int(parts[1]) - self.first_head
            if 0 <= row < self.num_heads:          # other ranks' heads are theirs to load
                self.weight.data[row].copy_(tensor)
                filled.add(row)
        loaded = {"weight"} if len(filled) == self.num_heads else set()
        if unexpected:
            raise UnexpectedWeightsError(type(self).__name__, unexpected, loaded,
                                         {"": ["norms.<head>.weight"]})
        return loaded


class StablelmAttention(LlamaAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs["config"]
        self.qk_layernorm = getattr(config, "qk_layernorm", False)
        if self.qk_layernorm:
            q_first, kv_first = local_head_starts(self)
            eps = _norm_eps(config)
            self.q_layernorm = StablelmLayerNormPerHead(self.head_dim, self.num_heads, q_first,
                                                        eps)
            self.k_layernorm = StablelmLayerNormPerHead(self.head_dim, self.num_kv_heads,
                                                        kv_first, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))        # [T, H]
        return output


class StablelmDecoderLayer(nn.Module):
    """Pre-norm block in the Llama layer protocol `(hidden, residual) -> (hidden, residual)`."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.self_attn = StablelmAttention(
            config=config, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            max_position_embeddings=config.max_position_embeddings, quant_config=quant_config,
            bias=getattr(config, "use_qkv_bias", False), bias_o_proj=False,
            cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.use_parallel_residual = getattr(config, "use_parallel_residual", False)
        self.input_layernorm = LayerNorm(config.hidden_size, eps=_norm_eps(config))
        if not self.use_parallel_residual:
            self.post_attention_layernorm = LayerNorm(config.hidden_size, eps=_norm_eps(config))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        attn = self.self_attn(positions=positions, hidden_states=hidden_states)
        if self.use_parallel_residual:             # both branches read the same normed input
            return attn + self.mlp(hidden_states), residual
        hidden_states, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(hidden_states), residual


class StableLMEpochModel(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = StablelmDecoderLayer) -> None:
        config = vllm_config.model_config.hf_config
        # NOTE: LlamaModel builds its final RMSNorm from `rms_norm_eps`, which StableLM configs
        # lack; that norm is replaced by StableLM's LayerNorm right after.
        if not hasattr(config, "rms_norm_eps"):
            config.rms_norm_eps = _norm_eps(config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        if not isinstance(self.norm, PPMissingLayer):     # the last PP stage holds the norm
            self.norm = LayerNorm(config.hidden_size, eps=_norm_eps(config))


class StablelmForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = StablelmDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = StablelmDecoderLayer) -> nn.Module:
        return StableLMEpochModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
