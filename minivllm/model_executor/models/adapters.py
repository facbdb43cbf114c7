"""Turn a causal LM class into an embedding or a sequence-classification model (contract §1.2).

Both adapters are called when llama.py is imported, so they must work with no current config;
everything that needs one happens inside the returned class's `__init__`.
"""

from collections.abc import Iterable
from typing import Any, TypeVar

import torch
import torch.nn as nn

from minivllm.config.pooler import PoolerConfig, resolve_pooler_config
from minivllm.model_executor.layers.linear import ReplicatedLinear
from minivllm.model_executor.layers.pooler import Pooler
from minivllm.model_executor.models.interfaces import SupportsCrossEncoding
from minivllm.model_executor.models.utils import (AutoWeightsLoader, StageMissingLayer, maybe_prefix,
                                                 no_init_weights)

_T = TypeVar("_T", bound=type[nn.Module])

# The output stage a pooling model never runs; replaced by StageMissingLayer("output").
_OUTPUT_STAGE_CLASSES = ("LogitsProcessor", "ParallelLMHead")
_GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel")


def as_embedding_model(cls: _T) -> _T:
    """A subclass of `cls` whose `pooler` returns one L2-normalised embedding per sequence."""
    if getattr(cls, "is_pooling_model", False):
        return cls

    class ModelForEmbedding(_create_pooling_model_cls(cls)):
        def _build_pooler(self, vllm_config: Any, prefix: str) -> nn.Module:
            return Pooler.from_pooler_config(_pooler_config(vllm_config))

    return _named(ModelForEmbedding, cls, "EmbeddingModel")


def as_seq_cls_model(cls: _T) -> _T:
    """A subclass of `cls` with a `score` head: the pooler returns `[B, num_labels]` logits."""
    if getattr(cls, "is_pooling_model", False):
        return cls

    class ModelForSequenceClassification(_create_pooling_model_cls(cls), SupportsCrossEncoding):
        def _build_pooler(self, vllm_config: Any, prefix: str) -> nn.Module:
            config = vllm_config.model_config.hf_config.get_text_config()
            self.score = ReplicatedLinear(config.hidden_size, config.num_labels, bias=False,
                                          quant_config=vllm_config.quant_config, return_bias=False,
                                          prefix=maybe_prefix(prefix, "score"))
            # A closure, so `score` stays registered once (under `score`, as in checkpoints).
            return Pooler.for_seq_cls(lambda pooled: self.score(pooled), _pooling_type(vllm_config))

    return _named(ModelForSequenceClassification, cls, "ForSequenceClassification")


def _create_pooling_model_cls(orig_cls: type[nn.Module]) -> type[nn.Module]:
    class ModelForPooling(orig_cls):
        is_pooling_model = True

        def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
            with no_init_weights(self, lambda module: StageMissingLayer("output", module),
                                 targets=_OUTPUT_STAGE_CLASSES):
                super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            self.pooler = self._build_pooler(vllm_config, prefix)

        def _build_pooler(self, vllm_config: Any, prefix: str) -> nn.Module:
            raise NotImplementedError

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            inner = getattr(self, "model", None)
            if hasattr(inner, "load_weights") and _only_inner_has_params(self):
                # vLLM's rule: then both `*ForCausalLM` checkpoints (`model.*`, `lm_head.*`)
                # and bare `*Model` ones (no prefix) load into the inner model.
                kept = ((name.removeprefix("model."), w) for name, w in weights
                        if not name.startswith("lm_head."))
                return {f"model.{name}" for name in inner.load_weights(kept)}
            # The output stage is a placeholder now, so `lm_head.*` weights are dropped.
            parent = getattr(super(), "load_weights", None)
            if parent is not None:
                return parent(weights)
            return AutoWeightsLoader(self).load_weights(weights)

    return ModelForPooling


def _only_inner_has_params(model: nn.Module) -> bool:
    return all(name == "model" or next(child.parameters(), None) is None
               for name, child in model.named_children())


def _pooler_config(vllm_config: Any) -> PoolerConfig:
    """The engine's resolved PoolerConfig; completed here for a model built outside an engine
    (the model's default: HF `pooling`, else LAST, normalised)."""
    model_config = vllm_config.model_config
    pooler_config = getattr(model_config, "pooler_config", None)
    if isinstance(pooler_config, PoolerConfig) and pooler_config.effective_pooling_type \
            and pooler_config.normalize is not None:
        return pooler_config
    return resolve_pooler_config(pooler_config, "", model_config.hf_config)


def _pooling_type(vllm_config: Any) -> str:
    return _pooler_config(vllm_config).effective_pooling_type


def _named(new_cls: type, orig_cls: type, suffix: str) -> Any:
    base = orig_cls.__name__
    for generative in _GENERATIVE_SUFFIXES:
        if base.endswith(generative):
            base = base[: -len(generative)]
            break
    new_cls.__name__ = new_cls.__qualname__ = base + suffix
    new_cls.__module__ = orig_cls.__module__
    return new_cls
