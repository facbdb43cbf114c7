"""Llava (llava-1.5 / llava-interleave / Pixtral-12B's HF format ...), TEXT ONLY: the language
model (Llama, Mistral, Qwen2, ... by the text config) without the CLIP / SigLIP tower and the
projector (see `text_only`)."""

from .llama import LlamaForCausalLM
from .text_only import (LANGUAGE_MODEL_PREFIXES, LanguageModelFromTextConfig,
                        TextOnlyConditionalGeneration, text_of_vl_mapper, tower_prefixes)


class LlavaForConditionalGeneration(LanguageModelFromTextConfig, TextOnlyConditionalGeneration,
                                    LlamaForCausalLM):
    """Built on Llama; a text config of another family builds the same class on that family's
    causal LM (`LanguageModelFromTextConfig`)."""

    skipped_prefixes = tower_prefixes("vision_tower", "multi_modal_projector")
    hf_to_vllm_mapper = text_of_vl_mapper(LANGUAGE_MODEL_PREFIXES, skipped_prefixes)


__all__ = ["LlavaForConditionalGeneration"]
