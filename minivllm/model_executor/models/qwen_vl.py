"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints served TEXT ONLY, as their
language model (see text_only.py): Qwen2 for the first two, Qwen3 and Qwen3-MoE for the others.

What makes that exact for text prompts:
- M-RoPE: the text config's rope parameters carry `mrope_section` (and `mrope_interleaved` for
  Qwen3-VL), so `get_rope` builds `MRotaryEmbedding`; a text token's T, H and W positions are
  equal, and minivllm's 1-D positions rotate as plain RoPE.
- Qwen3-VL's deepstack adds vision features into the first text layers' hidden states only at
  image / video tokens; with none, its text model is plain Qwen3 (Qwen3-MoE for the MoE one).

Checkpoint names: Qwen2(.5)-VL files keep the pre-transformers-5 layout (`model.layers.*`,
`visual.*`, `lm_head.*`; transformers 5 saves it so too), Qwen3-VL files nest the language model
(`model.language_model.*`, `model.visual.*`). Both load; the vision tower is skipped. Qwen3-VL-MoE
stores its experts fused, transposed in released files and not in transformers 5's saves; both
load (see `_fused_experts_as_run`).
"""

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.quantization import QuantizationConfig

from .qwen2 import Qwen2ForCausalLM
from .qwen2_moe import SparseMoeBlock
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM
from .text_only import (LANGUAGE_MODEL_PREFIXES, TextOnlyConditionalGeneration,
                        text_of_vl_mapper, tower_prefixes)

# Both layouts: the nested one and the older flat one (whose `model.` names already are the
# causal LM's).
_SKIPPED = tower_prefixes("visual")
_QWEN_VL_MAPPER = text_of_vl_mapper(LANGUAGE_MODEL_PREFIXES, _SKIPPED)


class _QwenVLTextOnly(TextOnlyConditionalGeneration):
    """The shared text-only mixin plus the LM-head tying, which these configs keep on the outer
    config: the text config lacks the field (Qwen2-VL, Qwen3-VL) or defaults it differently
    (Qwen3-VL-MoE's text config says True where the outer one says False)."""

    skipped_prefixes = _SKIPPED

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        hf_config = vllm_config.model_config.hf_config
        text_config = vllm_config.model_config.hf_text_config
        if text_config is not hf_config:
            text_config.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings",
                                                           False))
        super().__init__(vllm_config=vllm_config, prefix=prefix)


class Qwen2VLForConditionalGeneration(_QwenVLTextOnly, Qwen2ForCausalLM):
    """Qwen2-VL served text-only: Qwen2 with M-RoPE (sectioned) on text positions."""

    hf_to_vllm_mapper = _QWEN_VL_MAPPER | Qwen2ForCausalLM.hf_to_vllm_mapper


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL served text-only: its language model is Qwen2-VL's (the tower differs)."""


class Qwen3VLForConditionalGeneration(_QwenVLTextOnly, Qwen3ForCausalLM):
    """Qwen3-VL served text-only: Qwen3 with interleaved M-RoPE; no deepstack without images."""

    hf_to_vllm_mapper = _QWEN_VL_MAPPER | Qwen3ForCausalLM.hf_to_vllm_mapper


class Qwen3VLMoeDecoderLayer(Qwen3MoeDecoderLayer):
    """Qwen3-MoE's layer reading fused, transposed expert tensors. The router always
    renormalises its top-k (transformers' Qwen3-VL-MoE router does; configs may omit
    `norm_topk_prob`)."""

    def make_moe(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return SparseMoeBlock(config, config.num_experts, config.moe_intermediate_size,
                              getattr(config, "norm_topk_prob", True), quant_config, prefix)


class Qwen3VLMoeForConditionalGeneration(_QwenVLTextOnly, Qwen3MoeForCausalLM):
    """Qwen3-VL-MoE served text-only: Qwen3-MoE with interleaved M-RoPE."""

    layer_cls = Qwen3VLMoeDecoderLayer
    hf_to_vllm_mapper = _QWEN_VL_MAPPER | Qwen3MoeForCausalLM.hf_to_vllm_mapper

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        config = self.model.config
        return super().load_weights(_fused_experts_as_run(weights, config.hidden_size,
                                                          config.moe_intermediate_size))


def _fused_experts_as_run(weights: Iterable[tuple[str, torch.Tensor]], hidden_size: int,
                          intermediate_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused expert tensors in the layout they run in: `gate_up_proj [E, 2I, H]` (gate rows
    first) and `down_proj [E, H, I]`. Released checkpoints store them transposed
    (`[E, H, 2I]`, `[E, I, H]`; vLLM always transposes them), transformers 5 saves them as run;
    as transformers, a tensor is transposed only when its shape is not the run one.
    NOTE: a square expert matrix (H == 2I for gate_up, H == I for down) cannot tell the two
    layouts apart and is read as run; no released Qwen3-VL-MoE has such sizes."""
    run_shapes = {".experts.gate_up_proj": (2 * intermediate_size, hidden_size),
                  ".experts.down_proj": (hidden_size, intermediate_size)}
    for name, tensor in weights:
        shape = next((s for suffix, s in run_shapes.items() if name.endswith(suffix)), None)
        if shape is not None and tensor.dim() == 3 and tuple(tensor.shape[1:]) != shape:
            tensor = tensor.transpose(1, 2)
        yield name, tensor


__all__ = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
           "Qwen3VLForConditionalGeneration", "Qwen3VLMoeDecoderLayer",
           "Qwen3VLMoeForConditionalGeneration"]
