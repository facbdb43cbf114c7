"""Idefics3 and SmolVLM (SmolVLM / SmolVLM2), TEXT ONLY: their Llama text model without the
SigLIP tower and the pixel-shuffle connector (see `text_only`)."""

from .llama import LlamaForCausalLM
from .text_only import TextOnlyConditionalGeneration, text_of_vl_mapper, tower_prefixes

# transformers names the text model `model.text_model` (its head stays `lm_head`).
_TOWERS = tower_prefixes("vision_model", "connector")
_MAPPER = text_of_vl_mapper({"model.text_model.": "model."}, _TOWERS)


class Idefics3ForConditionalGeneration(TextOnlyConditionalGeneration, LlamaForCausalLM):
    """Idefics3's checkpoints served as their Llama text model."""

    skipped_prefixes = _TOWERS
    hf_to_vllm_mapper = _MAPPER


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM: Idefics3's layout under another name (the processors differ, not the model)."""


__all__ = ["Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"]
