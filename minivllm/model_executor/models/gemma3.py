"""Gemma 3 (text): Gemma 2's layers with QK-norm instead of the attention soft cap and a RoPE per
layer type (local layers keep a short-range base)."""

from typing import Any

from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig

from .gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from .text_only import (LANGUAGE_MODEL_PREFIXES, TextOnlyConditionalGeneration,
                        text_of_vl_mapper, tower_prefixes)


def gemma3_rope_parameters(config: Any, layer_type: str) -> dict[str, Any] | None:
    """The RoPE of a layer type: transformers v5 nests `rope_parameters` by layer type; older
    configs give the local layers `rope_local_base_freq`."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        return params[layer_type]
    if layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    return params or None


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's sandwich-norm block with QK-norm and per-layer-type RoPE."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("use_bidirectional_attention=True (EmbeddingGemma) is not "
                                      "supported; only causal Gemma 3 (False)")
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def attention_features(self, config: Any, layer_type: str) -> dict[str, Any]:
        # NOTE: no attention soft cap: transformers' Gemma 3 keeps `attn_logit_softcapping` in
        # its config but never applies it (QK-norm bounds the logits instead).
        return {"qk_norm": True, "rope_parameters": gemma3_rope_parameters(config, layer_type)}


@support_torch_compile
class Gemma3Model(Gemma2Model):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Gemma3DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model with its tied LM head (final soft cap only when the config sets one)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Gemma3DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Gemma3DecoderLayer) -> nn.Module:
        return Gemma3Model(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Gemma3ForConditionalGeneration(TextOnlyConditionalGeneration, Gemma3ForCausalLM):
    """Gemma 3's vision-language checkpoints (gemma-3-4b/12b/27b-it), TEXT ONLY (see
    `text_only`): the SigLIP tower and the projector are skipped."""

    skipped_prefixes = tower_prefixes("vision_tower", "multi_modal_projector")
    hf_to_vllm_mapper = text_of_vl_mapper(LANGUAGE_MODEL_PREFIXES, skipped_prefixes)


__all__ = ["Gemma3DecoderLayer", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
           "Gemma3Model", "gemma3_rope_parameters"]
