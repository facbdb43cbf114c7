"""Gemma 4's vision-language (and audio) checkpoints, TEXT ONLY: Gemma 4's text model built
from the nested `text_config`, without the vision / audio towers and their embedders (see
`text_only`)."""

from .gemma4 import Gemma4ForCausalLM
from .text_only import (LANGUAGE_MODEL_PREFIXES, TextOnlyConditionalGeneration,
                        text_of_vl_mapper, tower_prefixes)


class Gemma4ForConditionalGeneration(TextOnlyConditionalGeneration, Gemma4ForCausalLM):
    """Gemma 4 served as its language model; image and audio inputs are not accepted."""

    skipped_prefixes = tower_prefixes("vision_tower", "audio_tower", "embed_vision",
                                      "embed_audio")
    hf_to_vllm_mapper = text_of_vl_mapper(LANGUAGE_MODEL_PREFIXES, skipped_prefixes)


__all__ = ["Gemma4ForConditionalGeneration"]
