"""`Pooler`: the base of every pooler (vLLM's), and minivllm's plain pooler when built directly."""

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm.config import PoolerConfig
from minivllm.model_executor.layers.pooler.common import (PoolingParamsUpdate, PoolingType,
                                                          PromptLens, parse_pooling_type,
                                                          pool_sequences, split_tokens)


class Pooler(nn.Module):
    """Pools flattened hidden states `[T, H]` of a batch, sequence by sequence.

    Built directly it is the adapters' pooler: LAST / MEAN / CLS give `[B, H]` (`[B, C]`
    through `head`), ALL gives B x `[n_i, H]`; L2-normalised when `normalize`. vLLM's poolers
    (seqwise.py, tokwise.py, special.py and model files' own) subclass it and override
    `forward` and `get_supported_tasks`.
    """

    def __init__(self, pooling_type: PoolingType | str = PoolingType.LAST, *,
                 normalize: bool = True,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.pooling_type = parse_pooling_type(pooling_type)
        self.normalize = normalize
        self.head = head

    @classmethod
    def for_embedding(cls, pooling_type: PoolingType | str = PoolingType.LAST,
                      normalize: bool = True) -> "Pooler":
        return cls(pooling_type, normalize=normalize)

    @classmethod
    def for_seq_cls(cls, head: Callable[[torch.Tensor], torch.Tensor],
                    pooling_type: PoolingType | str = PoolingType.LAST) -> "Pooler":
        return cls(pooling_type, normalize=False, head=head)

    @classmethod
    def from_pooler_config(cls, pooler_config: PoolerConfig) -> "Pooler":
        """An embedding pooler from a resolved `PoolerConfig` (config/pooler.py)."""
        return cls(pooler_config.effective_pooling_type, normalize=bool(pooler_config.normalize))

    def get_supported_tasks(self) -> set[str]:
        if self.pooling_type == PoolingType.ALL:
            return {"token_embed"}
        return {"classify"} if self.head is not None else {"embed"}

    def get_pooling_updates(self, task: str) -> PoolingParamsUpdate:
        return PoolingParamsUpdate()

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens
                ) -> torch.Tensor | list[torch.Tensor]:
        if self.pooling_type == PoolingType.ALL:
            per_token = split_tokens(hidden_states, prompt_lens)                      # B x [n_i, H]
            return [F.normalize(t, p=2, dim=-1) for t in per_token] if self.normalize else per_token
        pooled = pool_sequences(hidden_states, prompt_lens, self.pooling_type)        # [B, H]
        if self.head is not None:
            pooled = self.head(pooled)
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled


__all__ = ["Pooler"]
