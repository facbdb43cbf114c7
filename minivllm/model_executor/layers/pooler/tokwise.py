"""Token-wise pooling (vLLM's `pooler.tokwise`): one output per token of each sequence.

`AllPool` splits `[T, H]` into each sequence's `[n_i, H]`; a head then maps each token's vector
(`TokenEmbeddingPoolerHead`: projector, then L2 norm; `TokenClassifierPoolerHead`: per-token
logits `[n_i, C]`, raw unless an activation is passed). vLLM's STEP pooling (process reward
models) needs the prompt token ids, which minivllm's runner does not pass: only ALL exists.
"""

from collections.abc import Callable
from typing import TypeAlias

import torch
import torch.nn as nn

from minivllm.config import PoolerConfig
from minivllm.model_executor.layers.pooler.abstract import Pooler
from minivllm.model_executor.layers.pooler.common import (ClassifierFn, PoolingParamsUpdate,
                                                          PoolingType, ProjectorFn, PromptLens,
                                                          run_head, split_tokens)
from minivllm.model_executor.layers.pooler.seqwise import (ActivationFn, current_head_dtype,
                                                           l2_normalize)

TokenPoolingMethodOutput: TypeAlias = list[torch.Tensor]     # B x [n_i, H]
TokenPoolerOutput: TypeAlias = list[torch.Tensor]
TokenPoolingFn = Callable[[torch.Tensor, PromptLens], TokenPoolingMethodOutput]
TokenPoolingHeadFn = Callable[[TokenPoolingMethodOutput, PromptLens], TokenPoolerOutput]


class TokenPoolingMethod(nn.Module):
    def get_supported_tasks(self) -> set[str]:
        return {"token_embed", "token_classify"}

    def get_pooling_updates(self, task: str) -> PoolingParamsUpdate:
        return PoolingParamsUpdate()


class AllPool(TokenPoolingMethod):
    """Every token: B x `[n_i, H]`."""

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens
                ) -> TokenPoolingMethodOutput:
        return split_tokens(hidden_states, prompt_lens)


def get_tok_pooling_method(pooling_type: PoolingType | str) -> TokenPoolingMethod:
    name = pooling_type.value if isinstance(pooling_type, PoolingType) else str(pooling_type)
    if name.upper() != PoolingType.ALL.value:
        raise ValueError(f"Token pooling type {pooling_type!r} is not supported; choose ALL")
    return AllPool()


class TokenPoolerHead(nn.Module):
    """Applies `forward_chunk` to each sequence's `[n_i, H]`."""

    def get_supported_tasks(self) -> set[str]:
        raise NotImplementedError

    def forward_chunk(self, pooled_data: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, pooled_data: TokenPoolingMethodOutput, prompt_lens: PromptLens
                ) -> TokenPoolerOutput:
        # NOTE: a loop over sequences: each has its own token count.
        return [self.forward_chunk(d) for d in pooled_data]


class TokenEmbeddingPoolerHead(TokenPoolerHead):
    def __init__(self, projector: ProjectorFn | None = None, head_dtype: torch.dtype | None = None,
                 activation: ActivationFn | None = None) -> None:
        super().__init__()
        self.projector = projector
        self.head_dtype = head_dtype
        self.activation = activation

    def get_supported_tasks(self) -> set[str]:
        return {"token_embed"}

    def forward_chunk(self, pooled_data: torch.Tensor) -> torch.Tensor:
        return run_head(pooled_data, self.head_dtype, self.projector, self.activation)


class TokenClassifierPoolerHead(TokenPoolerHead):
    def __init__(self, classifier: ClassifierFn | None = None,
                 head_dtype: torch.dtype | None = None, activation: ActivationFn | None = None
                 ) -> None:
        super().__init__()
        self.classifier = classifier
        self.head_dtype = head_dtype
        self.activation = activation

    def get_supported_tasks(self) -> set[str]:
        return {"token_classify"}

    def forward_chunk(self, pooled_data: torch.Tensor) -> torch.Tensor:
        return run_head(pooled_data, self.head_dtype, self.classifier,
                        self.activation)                                      # [n_i, C]


class TokenPooler(Pooler):
    """A token pooling method, then (optionally) a per-token head."""

    def __init__(self, pooling: TokenPoolingMethod | TokenPoolingFn,
                 head: TokenPoolerHead | TokenPoolingHeadFn | None = None) -> None:
        nn.Module.__init__(self)
        self.pooling = pooling
        self.head = head

    def get_supported_tasks(self) -> set[str]:
        tasks = {"token_embed", "token_classify"}
        for part in (self.pooling, self.head):
            if isinstance(part, (TokenPoolingMethod, TokenPoolerHead)):
                tasks &= part.get_supported_tasks()
        return tasks

    def get_pooling_updates(self, task: str) -> PoolingParamsUpdate:
        return PoolingParamsUpdate()

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens) -> TokenPoolerOutput:
        pooled = self.pooling(hidden_states, prompt_lens)
        return pooled if self.head is None else self.head(pooled, prompt_lens)


def pooler_for_token_embed(pooler_config: PoolerConfig, projector: ProjectorFn | None = None
                           ) -> TokenPooler:
    """Every token's vector, projected, normalised unless `normalize` is False."""
    head = TokenEmbeddingPoolerHead(
        projector, head_dtype=current_head_dtype(),
        activation=None if pooler_config.normalize is False else l2_normalize)
    return TokenPooler(get_tok_pooling_method(pooler_config.get_tok_pooling_type()), head)


def pooler_for_token_classify(pooler_config: PoolerConfig, *,
                              pooling: TokenPoolingMethod | TokenPoolingFn | None = None,
                              classifier: ClassifierFn | None = None,
                              act_fn: ActivationFn | None = None) -> TokenPooler:
    """Per-token logits of `classifier` (the hidden states themselves without one)."""
    if pooling is None:
        pooling = get_tok_pooling_method(pooler_config.get_tok_pooling_type())
    head = TokenClassifierPoolerHead(classifier, head_dtype=current_head_dtype(), activation=act_fn)
    return TokenPooler(pooling, head)


__all__ = ["AllPool", "TokenClassifierPoolerHead", "TokenEmbeddingPoolerHead", "TokenPooler",
           "TokenPoolerHead", "TokenPoolerOutput", "TokenPoolingMethod", "get_tok_pooling_method",
           "pooler_for_token_classify", "pooler_for_token_embed"]
