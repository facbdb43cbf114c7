"""Vision-language checkpoints served as their language model: text prompts only.

Many families people run ship only as vision-language checkpoints (Gemma 3 from 4B up, Qwen3.5,
Gemma 3n, Ministral 3, ...). minivllm has no vision or audio towers, so such a checkpoint is
served as the causal LM inside it: the language model's weights load under the causal LM's
names, the towers' and projectors' weights are skipped (counted in one log line), and the model
is built from the text config. Image, video and audio inputs are not accepted.

A family's class puts `TextOnlyConditionalGeneration` before its causal-LM class and sets
`skipped_prefixes` and `hf_to_vllm_mapper` (language-model names -> the causal LM's, see
`text_of_vl_mapper`). Where the text config may name another family (Llava over Llama, Mistral
or Qwen2), `LanguageModelFromTextConfig` goes first and builds the class on that family's
causal LM instead.
"""

import copy
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.logger import init_logger

from .utils import AutoWeightsLoader
from .weights_mapper import WeightsMapper


def text_only_view(vllm_config: VllmConfig) -> VllmConfig:
    """A shallow copy of `vllm_config` whose `hf_config` is the language model's config (model
    bodies read `hf_config`); every other part is shared with the engine's config."""
    model_config = copy.copy(vllm_config.model_config)
    model_config.hf_config = vllm_config.model_config.hf_text_config
    view = copy.copy(vllm_config)
    view.model_config = model_config
    return view


def text_of_vl_mapper(language_model: Mapping[str, str],
                      skipped: Sequence[str] = ()) -> WeightsMapper:
    """Prefix renames for a vision-language checkpoint: `language_model` maps the language
    model's prefixes onto the causal LM's (e.g. `{"model.language_model.": "model."}`), and
    every prefix in `skipped` is dropped. Weights under neither keep their names (e.g.
    `lm_head.`), so a tower prefix nobody listed shows up as an unexpected weight."""
    return WeightsMapper(orig_to_new_prefix={**dict.fromkeys(skipped), **language_model})


# Where vision-language checkpoints keep their language model: transformers v5 saves it under
# `model.language_model.` (head `lm_head.`); the v4-era files on the Hub say
# `language_model.model.` and `language_model.lm_head.`. Both load as the causal LM's names.
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                           "language_model.lm_head.": "lm_head."}


def tower_prefixes(*names: str) -> tuple[str, ...]:
    """The checkpoint prefixes of the named towers / projectors in both layouts:
    `tower_prefixes("vision_tower")` -> `("model.vision_tower.", "vision_tower.")`."""
    return tuple(p for name in names for p in (f"model.{name}.", f"{name}."))


def causal_lm_of_text_config(text_config: Any) -> type[nn.Module]:
    """minivllm's causal-LM class for a nested text config: by its `architectures` when it names
    them, else by transformers' causal-LM class for its `model_type` (`qwen2` ->
    `Qwen2ForCausalLM`). Raises ValueError listing the supported architectures otherwise."""
    from .registry import ModelRegistry      # the registry imports model files lazily

    archs = list(getattr(text_config, "architectures", None) or [])
    if not archs:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        model_type = getattr(text_config, "model_type", "")
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(f"text_config.model_type={model_type!r} has no causal-LM class "
                             "in transformers, so its language model cannot be served")
        archs = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return ModelRegistry.resolve_model_cls(archs)[0]


class TextOnlyConditionalGeneration:
    """Mixin before a causal-LM class: built from the text config, loads the language model's
    weights through `hf_to_vllm_mapper`, skips the weights under `skipped_prefixes`."""

    # Checkpoint-name prefixes of the towers / projectors this class skips (also in its mapper).
    skipped_prefixes: tuple[str, ...] = ()
    hf_to_vllm_mapper: WeightsMapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=text_only_view(vllm_config), prefix=prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        counted = _count_skipped(weights, self.skipped_prefixes, type(self))
        return AutoWeightsLoader(self).load_weights(counted, mapper=self.hf_to_vllm_mapper)


class LanguageModelFromTextConfig:
    """Mixin before `TextOnlyConditionalGeneration` for wrappers whose language model may be of
    several families: when the text config's causal LM is not the class's own base, the same
    text-only class (same name, prefixes and mapper) is built on that causal LM instead."""

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = "") -> Any:
        text_cls = causal_lm_of_text_config(vllm_config.model_config.hf_text_config)
        if not issubclass(cls, text_cls):
            if LanguageModelFromTextConfig not in cls.__bases__:
                # A subclass (a pooling adapter, say) would lose its own methods on the swap.
                raise NotImplementedError(
                    f"{cls.__name__} (a subclass of a text-only class) is only supported on the "
                    f"class's own causal LM, not on {text_cls.__name__}")
            # Not an instance of `cls`, so Python does not run `cls.__init__` on it again.
            return _on_causal_lm(cls, text_cls)(vllm_config=vllm_config, prefix=prefix)
        base_new = super().__new__
        if base_new is object.__new__:
            return base_new(cls)
        return base_new(cls, vllm_config=vllm_config, prefix=prefix)


@functools.cache
def _on_causal_lm(cls: type, causal_lm_cls: type[nn.Module]) -> type[nn.Module]:
    """`cls`'s text-only class on another causal LM; one class per pair, so a model's type is
    stable across engines."""
    attrs = {"skipped_prefixes": cls.skipped_prefixes,
             "hf_to_vllm_mapper": cls.hf_to_vllm_mapper,
             "__module__": cls.__module__, "__qualname__": cls.__qualname__,
             "__doc__": f"{cls.__name__} on {causal_lm_cls.__name__}, TEXT ONLY"}
    return type(cls.__name__, (TextOnlyConditionalGeneration, causal_lm_cls), attrs)


def _count_skipped(weights: Iterable[tuple[str, torch.Tensor]], skipped: tuple[str, ...],
                   model_cls: type) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes every weight on (the mapper drops the skipped ones) and says once, at the end,
    how many belonged to the skipped towers (logged as the family's module)."""
    num_skipped = 0
    for weight_name, tensor in weights:
        num_skipped += weight_name.startswith(skipped)
        yield weight_name, tensor
    init_logger(model_cls.__module__).info(
        "%s is served text-only: skipped %d vision / audio tower weights (%s); image, video "
        "and audio inputs are not supported", model_cls.__name__, num_skipped,
        ", ".join(skipped) or "none listed")


__all__ = ["LANGUAGE_MODEL_PREFIXES", "LanguageModelFromTextConfig",
           "TextOnlyConditionalGeneration", "causal_lm_of_text_config", "text_of_vl_mapper",
           "text_only_view", "tower_prefixes"]
