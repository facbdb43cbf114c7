"""Sequence-wise pooling (vLLM's `pooler.seqwise`): one output per sequence.

A `SequencePooler` is a pooling method (CLS / LAST / MEAN: `[T, H]` -> `[B, H]`) followed by a
head: `EmbeddingPoolerHead` (optional projector, then L2 norm) or `ClassifierPoolerHead`
(classifier -> logits `[B, C]`). minivllm returns a classifier's raw logits (no softmax), as its
pooling engine always has; a head applies an activation only when one is passed.
"""

from collections.abc import Callable
from typing import TypeAlias

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm.config import PoolerConfig, get_current_vllm_config_or_none
from minivllm.model_executor.layers.pooler.abstract import Pooler
from minivllm.model_executor.layers.pooler.common import (ClassifierFn, PoolingParamsUpdate,
                                                          PoolingType, ProjectorFn, PromptLens,
                                                          parse_pooling_type, pool_sequences,
                                                          run_head)

SequencePoolingMethodOutput: TypeAlias = torch.Tensor | list[torch.Tensor]   # [B, H]
SequencePoolerHeadOutput: TypeAlias = torch.Tensor | list[torch.Tensor]
SequencePoolerOutput: TypeAlias = torch.Tensor | list[torch.Tensor]
SequencePoolingFn = Callable[[torch.Tensor, PromptLens], SequencePoolingMethodOutput]
SequencePoolingHeadFn = Callable[[SequencePoolingMethodOutput, PromptLens],
                                 SequencePoolerHeadOutput]
ActivationFn = Callable[[torch.Tensor], torch.Tensor]


class SequencePoolingMethod(nn.Module):
    """`[T, H]` hidden states of whole prompts -> `[B, H]`, one row per prompt."""

    pooling_type: PoolingType

    def get_supported_tasks(self) -> set[str]:
        return {"embed", "classify"}

    def get_pooling_updates(self, task: str) -> PoolingParamsUpdate:
        return PoolingParamsUpdate()

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens) -> torch.Tensor:
        return pool_sequences(hidden_states, prompt_lens, self.pooling_type)


class CLSPool(SequencePoolingMethod):
    pooling_type = PoolingType.CLS


class LastPool(SequencePoolingMethod):
    pooling_type = PoolingType.LAST


class MeanPool(SequencePoolingMethod):
    pooling_type = PoolingType.MEAN


_METHODS: dict[PoolingType, type[SequencePoolingMethod]] = {
    PoolingType.CLS: CLSPool, PoolingType.LAST: LastPool, PoolingType.MEAN: MeanPool}


def get_seq_pooling_method(pooling_type: PoolingType | str) -> SequencePoolingMethod:
    parsed = parse_pooling_type(pooling_type)
    if parsed not in _METHODS:
        raise ValueError(f"{parsed.value} is not a sequence pooling type; choose one of "
                         f"{[t.value for t in _METHODS]}")
    return _METHODS[parsed]()


class SequencePoolerHead(nn.Module):
    """Pooled `[B, H]` -> the task's output."""

    def get_supported_tasks(self) -> set[str]:
        raise NotImplementedError


class EmbeddingPoolerHead(SequencePoolerHead):
    """Cast to `head_dtype`, project (a sentence-transformers Dense, BERT's tanh pooler), then
    `activation` (L2 normalisation for an embedding; None keeps the projection as it is)."""

    def __init__(self, projector: ProjectorFn | None = None,
                 head_dtype: torch.dtype | None = None, activation: ActivationFn | None = None
                 ) -> None:
        super().__init__()
        self.projector = projector
        self.head_dtype = head_dtype
        self.activation = activation

    def get_supported_tasks(self) -> set[str]:
        return {"embed"}

    def forward(self, pooled_data: SequencePoolingMethodOutput, prompt_lens: PromptLens
                ) -> torch.Tensor:
        pooled = torch.stack(pooled_data) if isinstance(pooled_data, list) else pooled_data
        return run_head(pooled, self.head_dtype, self.projector, self.activation)


class ClassifierPoolerHead(SequencePoolerHead):
    """Pooled `[B, H]` -> `classifier` -> logits `[B, C]` (then `activation`, when given)."""

    def __init__(self, classifier: ClassifierFn | None = None,
                 head_dtype: torch.dtype | None = None, activation: ActivationFn | None = None
                 ) -> None:
        super().__init__()
        self.classifier = classifier
        self.head_dtype = head_dtype
        self.activation = activation

    def get_supported_tasks(self) -> set[str]:
        return {"classify"}

    def forward(self, pooled_data: SequencePoolingMethodOutput, prompt_lens: PromptLens
                ) -> torch.Tensor:
        pooled = torch.stack(pooled_data) if isinstance(pooled_data, list) else pooled_data
        return run_head(pooled, self.head_dtype, self.classifier, self.activation)  # [B, C]


class SequencePooler(Pooler):
    """A pooling method, then a head: `head(pooling(hidden_states, lens), lens)`."""

    def __init__(self, pooling: SequencePoolingMethod | SequencePoolingFn,
                 head: SequencePoolerHead | SequencePoolingHeadFn) -> None:
        nn.Module.__init__(self)
        self.pooling = pooling
        self.head = head

    def get_supported_tasks(self) -> set[str]:
        tasks = {"embed", "classify"}
        for part in (self.pooling, self.head):
            if isinstance(part, (SequencePoolingMethod, SequencePoolerHead)):
                tasks &= part.get_supported_tasks()
        return tasks

    def get_pooling_updates(self, task: str) -> PoolingParamsUpdate:
        if isinstance(self.pooling, SequencePoolingMethod):
            return self.pooling.get_pooling_updates(task)
        return PoolingParamsUpdate()

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens
                ) -> SequencePoolerOutput:
        return self.head(self.pooling(hidden_states, prompt_lens), prompt_lens)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=2, dim=-1)


def current_head_dtype() -> torch.dtype | None:
    """The running model's head dtype (None outside an engine: keep the input's dtype)."""
    vllm_config = get_current_vllm_config_or_none()
    return None if vllm_config is None else vllm_config.model_config.head_dtype


def pooler_for_embed(pooler_config: PoolerConfig) -> SequencePooler:
    """The config's sequence pooling (LAST unless set), normalised unless `normalize` is False."""
    activation = None if pooler_config.normalize is False else l2_normalize
    head = EmbeddingPoolerHead(head_dtype=current_head_dtype(), activation=activation)
    return SequencePooler(get_seq_pooling_method(pooler_config.get_seq_pooling_type()), head)


def pooler_for_classify(pooler_config: PoolerConfig, *,
                        pooling: SequencePoolingMethod | SequencePoolingFn | None = None,
                        classifier: ClassifierFn | None = None,
                        act_fn: ActivationFn | None = None) -> SequencePooler:
    """Logits of `classifier` on `pooling`'s output (the config's pooling type by default)."""
    if pooling is None:
        pooling = get_seq_pooling_method(pooler_config.get_seq_pooling_type())
    head = ClassifierPoolerHead(classifier, head_dtype=current_head_dtype(), activation=act_fn)
    return SequencePooler(pooling, head)


__all__ = ["CLSPool", "ClassifierPoolerHead", "EmbeddingPoolerHead", "LastPool", "MeanPool",
           "SequencePooler", "SequencePoolerHead", "SequencePoolerHeadOutput",
           "SequencePoolerOutput", "SequencePoolingFn", "SequencePoolingHeadFn",
           "SequencePoolingMethod", "SequencePoolingMethodOutput", "get_seq_pooling_method",
           "pooler_for_classify", "pooler_for_embed"]
