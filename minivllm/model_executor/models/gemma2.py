"""Gemma 2: Gemma with sandwich norms (before and after attention and MLP), attention logits
soft-capped and scaled by `query_pre_attn_scalar`, interleaved local (sliding) / global layers,
and soft-capped final logits."""

from typing import Any

import torch
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig
from minivllm.distributed import get_pp_group
from minivllm.model_executor.layers.layernorm import GemmaRMSNorm
from minivllm.model_executor.layers.logits_processor import LogitsProcessor

from .gemma import GemmaForCausalLM, GemmaModel, gemma_attention, gemma_mlp
from .llama import input_norm
from .utils import extract_layer_index


def gemma_layer_type(config: Any, layer_idx: int) -> str:
    """"sliding_attention" or "full_attention"; configs without `layer_types` alternate,
    starting with a sliding layer (Gemma 2's pattern)."""
    if layer_types := getattr(config, "layer_types", None):
        return layer_types[layer_idx]
    return "sliding_attention" if layer_idx % 2 == 0 else "full_attention"


class Gemma2DecoderLayer(nn.Module):
    """norm -> attention -> norm, + residual, norm -> MLP -> norm; the residual stream outside."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        layer_type = gemma_layer_type(config, extract_layer_index(prefix))
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.self_attn = gemma_attention(
            vllm_config, prefix, scaling=config.query_pre_attn_scalar**-0.5,
            sliding_window=window, **self.attention_features(config, layer_type))
        self.mlp = gemma_mlp(vllm_config, prefix)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps=eps)

    def attention_features(self, config: Any, layer_type: str) -> dict[str, Any]:
        """More GemmaAttention arguments for this layer (Gemma 3: QK-norm, per-type RoPE)."""
        return {"logits_soft_cap": getattr(config, "attn_logit_softcapping", None)}

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


@support_torch_compile
class Gemma2Model(GemmaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Gemma2DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 with its tied LM head; logits soft-capped by `final_logit_softcapping`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Gemma2DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        config = vllm_config.model_config.hf_config
        if get_pp_group().is_last_rank:
            self.logits_processor = LogitsProcessor(
                config.vocab_size, soft_cap=getattr(config, "final_logit_softcapping", None))

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Gemma2DecoderLayer) -> nn.Module:
        return Gemma2Model(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


__all__ = ["Gemma2DecoderLayer", "Gemma2ForCausalLM", "Gemma2Model", "gemma_layer_type"]
