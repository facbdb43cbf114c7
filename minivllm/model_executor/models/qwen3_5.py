"""Qwen3.5's language model (dense Qwen3.5-27B, MoE Qwen3.5-35B-A3B / 397B-A17B): Qwen3-Next's
hybrid stack with three differences.

- The Gated DeltaNet projections are flat: in_proj_qkv ([q | k | v] rows), in_proj_z, in_proj_b
  and in_proj_a, loaded as the shards of the shared layer's in_proj_qkvz / in_proj_ba.
- Every layer has the same MLP kind: a dense SwiGLU MLP (Qwen3.5) or the sparse block with its
  gated shared expert, top-k always renormalised (Qwen3.5-MoE).
- RoPE is configured as interleaved M-RoPE; for text every position axis holds the token's
  position, which is plain (partial) RoPE on 1-D positions (`text_rope_parameters`).

This file serves text only. vLLM's `SupportsMRoPE` (3-D positions for images and video) is not
implemented. The multimodal checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`) are served as their language model: the weights under
`model.language_model.` load, the vision tower's (`model.visual.`) are deliberately skipped, and
image / video inputs are not accepted.
"""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.quantization import QuantizationConfig

from .interfaces import HasInnerState, IsHybrid
from .llama import LlamaMLP
from .qwen2_moe import MoeForCausalLM
from .qwen3_next import (MTP_SKIPPER, Qwen3NextDecoderLayer, Qwen3NextModel,
                         QwenNextMixtureOfExperts, qwen_next_moe)
from .text_only import TextOnlyConditionalGeneration, text_of_vl_mapper, text_only_view
from .utils import AutoWeightsLoader, WeightsMapper

# The flat projections as shards of the fused ones: in_proj_qkv carries three ([q | k | v]).
_FLAT_GDN_MAPPER = WeightsMapper(orig_to_new_stacked={
    ".in_proj_qkv.": (".in_proj_qkvz.", (0, 1, 2)), ".in_proj_z.": (".in_proj_qkvz.", 3),
    ".in_proj_b.": (".in_proj_ba.", 0), ".in_proj_a.": (".in_proj_ba.", 1)})
# Some text-only checkpoints keep the multimodal model's `model.language_model.` prefix.
_TOP_LEVEL_MAPPER = MTP_SKIPPER | WeightsMapper(
    orig_to_new_prefix={"model.language_model.": "model."})
# The multimodal checkpoints: the language model's weights, without the vision tower's.
_VISION_TOWER = ("model.visual.",)
_TEXT_OF_VL_MAPPER = MTP_SKIPPER | text_of_vl_mapper({"model.language_model.": "model."},
                                                     _VISION_TOWER)
# NOTE: vLLM lists in_proj_qkvz as [in_proj_qkv, in_proj_z]; minivllm's LoRA gives each listed
# name one shard, and in_proj_qkv spans three (q, k, v), so here the fused layer is adaptable
# only whole: an adapter naming in_proj_qkv / in_proj_z is refused, never mis-sliced.
_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                   "gate_up_proj": ["gate_proj", "up_proj"],
                   "in_proj_qkvz": ["in_proj_qkvz"],
                   "in_proj_ba": ["in_proj_b", "in_proj_a"]}


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    """Qwen3-Next's layer with flat GDN projections and a dense MLP on every layer."""

    gqa_interleaved_layout = False

    def make_mlp(self, config: Any, layer_idx: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        quant_config=quant_config, prefix=prefix)


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    """The sparse block on every layer; Qwen3.5-MoE's router always renormalises the top-k."""

    def make_mlp(self, config: Any, layer_idx: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return qwen_next_moe(config, True, quant_config, prefix)


class Qwen3_5Model(Qwen3NextModel):
    hf_to_vllm_mapper = Qwen3NextModel.hf_to_vllm_mapper | _FLAT_GDN_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Qwen3_5DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Qwen3_5ForCausalLMBase(MoeForCausalLM, HasInnerState, IsHybrid):
    """Qwen3.5 (text) with an LM head; PP, LoRA as Llama; state slots for the GDN layers."""

    packed_modules_mapping = _PACKED_MODULES
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    model_cls = Qwen3_5Model
    hf_to_vllm_mapper = _TOP_LEVEL_MAPPER | Qwen3_5Model.hf_to_vllm_mapper

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Applied here: the model body's own mapper sees names without `model.`.
        return AutoWeightsLoader(self).load_weights(weights, mapper=_TOP_LEVEL_MAPPER)


class Qwen3_5ForCausalLM(Qwen3_5ForCausalLMBase):
    """Dense Qwen3.5: a SwiGLU MLP on every layer."""

    layer_cls = Qwen3_5DecoderLayer


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLMBase, QwenNextMixtureOfExperts):
    """Qwen3.5-MoE: the sparse block on every layer; the experts as `MixtureOfExperts`."""

    layer_cls = Qwen3_5MoeDecoderLayer

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.set_moe_parameters()


class Qwen3_5ForConditionalGeneration(TextOnlyConditionalGeneration, Qwen3_5ForCausalLM):
    """Qwen3.5's vision-language checkpoint, TEXT ONLY (see `text_only`): the vision tower's
    weights (`model.visual.*`) are skipped."""

    skipped_prefixes = _VISION_TOWER
    hf_to_vllm_mapper = _TEXT_OF_VL_MAPPER


class Qwen3_5MoeForConditionalGeneration(TextOnlyConditionalGeneration, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's vision-language checkpoint, TEXT ONLY (see `text_only`)."""

    skipped_prefixes = _VISION_TOWER
    hf_to_vllm_mapper = _TEXT_OF_VL_MAPPER


__all__ = ["Qwen3_5DecoderLayer", "Qwen3_5ForCausalLM", "Qwen3_5ForCausalLMBase",
           "Qwen3_5ForConditionalGeneration", "Qwen3_5Model", "Qwen3_5MoeDecoderLayer",
           "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "text_only_view"]
