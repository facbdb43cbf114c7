"""The pooler of the embedding / classification adapters: hidden states -> one output per sequence.

LAST / MEAN / CLS give one vector per sequence (`[B, H]`, or `[B, C]` through a head); ALL gives
each sequence's per-token vectors (a list of `[n_i, H]`). The model runner hands the pooler the
hidden states of whole prompts (chunked prefills are gathered first), so every type is exact.
"""

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class PoolingType(enum.Enum):
    LAST = "LAST"
    MEAN = "MEAN"
    CLS = "CLS"
    ALL = "ALL"


class Pooler(nn.Module):
    """Pools flattened hidden states `[T, H]` of a batch, sequence by sequence.

    `prompt_lens` gives each sequence's token count, in batch order (they sum to T).
    """

    def __init__(self, pooling_type: PoolingType | str = PoolingType.LAST, *, normalize: bool = True,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        if isinstance(pooling_type, str):
            valid = [t.value for t in PoolingType]
            if pooling_type.upper() not in valid:
                raise ValueError(f"Unknown pooling type {pooling_type!r}; choose one of {valid}")
            pooling_type = PoolingType(pooling_type.upper())
        self.pooling_type = pooling_type
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
    def from_pooler_config(cls, pooler_config: Any) -> "Pooler":
        """An embedding pooler from a resolved `PoolerConfig` (config/pooler.py)."""
        return cls(pooler_config.effective_pooling_type, normalize=bool(pooler_config.normalize))

    def forward(self, hidden_states: torch.Tensor, prompt_lens: Sequence[int] | torch.Tensor
                ) -> torch.Tensor | list[torch.Tensor]:
        lens = torch.as_tensor(prompt_lens, dtype=torch.long, device=hidden_states.device)   # [B]
        if self.pooling_type == PoolingType.ALL:
            per_token = hidden_states.split(lens.tolist())                                    # B x [n_i, H]
            if self.normalize:
                return [F.normalize(t, p=2, dim=-1) for t in per_token]
            return list(per_token)
        ends = torch.cumsum(lens, dim=0)                                                      # [B]
        if self.pooling_type == PoolingType.LAST:
            pooled = hidden_states[ends - 1]
        elif self.pooling_type == PoolingType.CLS:
            pooled = hidden_states[ends - lens]
        else:
            # Segment mean without a loop: token t belongs to sequence seq_ids[t].
            seq_ids = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)  # [T]
            sums = torch.zeros(len(lens), hidden_states.shape[-1], dtype=torch.float32,
                               device=hidden_states.device).index_add_(0, seq_ids, hidden_states.float())
            pooled = (sums / lens.unsqueeze(1)).to(hidden_states.dtype)                     # [B, H]
        if self.head is not None:
            pooled = self.head(pooled)
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled


class DispatchPooler(nn.Module):
    """vLLM 0.33's holder of one pooler per pooling task ("embed", "classify", ...), which its
    model files build. minivllm's pooling engine runs one task per model, so `forward` is the
    pooler of the task the holder was built for (`for_embedding`: "embed", `for_seq_cls`:
    "classify")."""

    def __init__(self, poolers_by_task: dict[str, nn.Module], task: str | None = None) -> None:
        super().__init__()
        if not poolers_by_task:
            raise ValueError("DispatchPooler needs at least one pooler")
        self.poolers_by_task = nn.ModuleDict(poolers_by_task)
        self.task = task or next(iter(poolers_by_task))
        if self.task not in self.poolers_by_task:
            raise ValueError(f"no pooler for task {self.task!r}; have {sorted(poolers_by_task)}")

    @classmethod
    def for_embedding(cls, pooler_config: Any) -> "DispatchPooler":
        return cls({"embed": Pooler.from_pooler_config(pooler_config)}, "embed")

    @classmethod
    def for_seq_cls(cls, pooler_config: Any, *, classifier: Callable[[torch.Tensor], torch.Tensor],
                    **_kernel_options: Any) -> "DispatchPooler":
        """Logits [B, num_labels] of `classifier` on each sequence's pooled state."""
        pooling = getattr(pooler_config, "seq_pooling_type", None) or PoolingType.LAST
        return cls({"classify": Pooler.for_seq_cls(classifier, pooling)}, "classify")

    def get_supported_tasks(self) -> set[str]:
        return set(self.poolers_by_task)

    def forward(self, hidden_states: torch.Tensor, prompt_lens: Sequence[int] | torch.Tensor
                ) -> torch.Tensor | list[torch.Tensor]:
        return self.poolers_by_task[self.task](hidden_states, prompt_lens)
