"""Mistral / Ministral 3: Llama with a model-wide sliding window and, for Ministral 3, Llama-4
attention scaling of q by position. HF-format checkpoints only (Mistral's consolidated format is
not read)."""

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig

from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .text_only import (LANGUAGE_MODEL_PREFIXES, LanguageModelFromTextConfig,
                        TextOnlyConditionalGeneration, text_of_vl_mapper, tower_prefixes)

if TYPE_CHECKING:     # annotations only: transformers is slow to import
    from transformers import MistralConfig


def llama_4_scaling(config: Any) -> tuple[float, int] | None:
    """(beta, original_max_position_embeddings) when the config asks for Llama-4 q scaling.

    vLLM's configs carry it as `llama_4_scaling = {"beta", "original_max_position_embeddings"}`;
    transformers' Ministral 3 puts `llama_4_scaling_beta` inside `rope_parameters`."""
    if (given := getattr(config, "llama_4_scaling", None)) is not None:
        return float(given["beta"]), int(given["original_max_position_embeddings"])
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("llama_4_scaling_beta") is not None:
        return float(rope["llama_4_scaling_beta"]), int(rope["original_max_position_embeddings"])
    return None


class MistralAttention(LlamaAttention):
    """Llama attention; with Llama-4 scaling q is multiplied (after RoPE) by
    `1 + beta * log(1 + floor(position / original_max))`, which grows with the position."""

    def __init__(self, config: "MistralConfig", *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.llama_4_scaling = llama_4_scaling(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.llama_4_scaling is None:
            return super().forward(positions, hidden_states)
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        beta, original_max = self.llama_4_scaling
        scale = 1 + beta * torch.log1p(torch.floor(positions.float() / original_max))   # [T]
        q = q * scale.to(q.dtype)[:, None]
        attn_output = self.attn(q, k, v)                   # [T, q_size]
        output, _ = self.o_proj(attn_output)               # [T, H]
        return output


class MistralDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with Mistral's attention."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "",
                 config: "MistralConfig | None" = None,
                 attn_layer_type: type[nn.Module] = MistralAttention) -> None:
        config = config or vllm_config.model_config.hf_config
        if getattr(config, "ada_rms_norm_t_cond", False):
            raise NotImplementedError("ada_rms_norm_t_cond=True (Voxtral's time-conditioned norm) "
                                      "is not supported; only ada_rms_norm_t_cond=False")
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)


@support_torch_compile
class MistralModel(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = MistralDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral with an LM head; `config.sliding_window` applies to every layer."""

    embedding_modules: dict[str, str] = {}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = MistralDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = MistralDecoderLayer) -> nn.Module:
        return MistralModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Mistral3ForConditionalGeneration(LanguageModelFromTextConfig, TextOnlyConditionalGeneration,
                                       MistralForCausalLM):
    """Mistral Small 3.1 / Ministral 3 vision-language checkpoints, TEXT ONLY (see `text_only`):
    the Pixtral tower and the projector are skipped; the language model is Mistral (text config
    `mistral` or `ministral3`), or whatever family another text config names."""

    skipped_prefixes = tower_prefixes("vision_tower", "multi_modal_projector")
    hf_to_vllm_mapper = text_of_vl_mapper(LANGUAGE_MODEL_PREFIXES, skipped_prefixes)


__all__ = ["MistralAttention", "MistralDecoderLayer", "MistralForCausalLM", "MistralModel",
           "Mistral3ForConditionalGeneration", "llama_4_scaling"]
