"""Shared pieces of the pooler package: pooling types, the pooling math, `PoolingParamsUpdate`.

Every pooler here is called as `pooler(hidden_states, prompt_lens)`: `hidden_states` `[T, H]`
holds whole prompts back to back (worker/pooling.py gathers chunked ones first) and
`prompt_lens` each prompt's token count in batch order (they sum to T). vLLM passes a
`PoolingMetadata` in that place; minivllm's runner has nothing else to pass.
"""

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ProjectorFn = Callable[[torch.Tensor], torch.Tensor]
ClassifierFn = Callable[[torch.Tensor], torch.Tensor]
PromptLens = Sequence[int] | torch.Tensor


class PoolingType(enum.Enum):
    LAST = "LAST"
    MEAN = "MEAN"
    CLS = "CLS"
    ALL = "ALL"


def parse_pooling_type(pooling_type: "PoolingType | str") -> PoolingType:
    """A `PoolingType` from itself or its name (any case); ValueError naming the valid ones."""
    if isinstance(pooling_type, PoolingType):
        return pooling_type
    valid = [t.value for t in PoolingType]
    if not isinstance(pooling_type, str) or pooling_type.upper() not in valid:
        raise ValueError(f"Unknown pooling type {pooling_type!r}; choose one of {valid}")
    return PoolingType(pooling_type.upper())


@dataclass
class PoolingParamsUpdate:
    """What a pooler needs from the runner besides hidden states (vLLM's name). minivllm's
    runner passes prompt lengths only, so a pooler asking for token ids cannot run here."""

    requires_token_ids: bool = False

    def __or__(self, other: "PoolingParamsUpdate") -> "PoolingParamsUpdate":
        return PoolingParamsUpdate(self.requires_token_ids or other.requires_token_ids)


def run_head(x: torch.Tensor, head_dtype: torch.dtype | None,
             fn: Callable[[torch.Tensor], torch.Tensor] | None,
             activation: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """What every pooler head does to its rows: cast to `head_dtype`, then `fn` (a projector
    or a classifier), then `activation`; each step skipped when None."""
    if head_dtype is not None:
        x = x.to(head_dtype)
    if fn is not None:
        x = fn(x)
    return activation(x) if activation is not None else x


def lens_tensor(prompt_lens: PromptLens, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(prompt_lens, dtype=torch.long, device=device)             # [B]


def pool_sequences(hidden_states: torch.Tensor, prompt_lens: PromptLens,
                   pooling_type: PoolingType) -> torch.Tensor:
    """One row per sequence, `[B, H]`, by LAST / CLS (first token) / MEAN."""
    lens = lens_tensor(prompt_lens, hidden_states.device)
    ends = torch.cumsum(lens, dim=0)                                                   # [B]
    if pooling_type == PoolingType.LAST:
        return hidden_states[ends - 1]
    if pooling_type == PoolingType.CLS:
        return hidden_states[ends - lens]
    if pooling_type != PoolingType.MEAN:
        raise ValueError(f"{pooling_type} gives one vector per token, not per sequence; "
                         "choose LAST, CLS or MEAN")
    # Segment mean without a loop: token t belongs to sequence seq_ids[t]; summed in fp32.
    seq_ids = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)  # [T]
    sums = torch.zeros(len(lens), hidden_states.shape[-1], dtype=torch.float32,
                       device=hidden_states.device).index_add_(0, seq_ids, hidden_states.float())
    return (sums / lens.unsqueeze(1)).to(hidden_states.dtype)                          # [B, H]


def split_tokens(hidden_states: torch.Tensor, prompt_lens: PromptLens) -> list[torch.Tensor]:
    """Each sequence's own rows: B x `[n_i, H]` (views, no copy)."""
    return list(hidden_states.split(lens_tensor(prompt_lens, hidden_states.device).tolist()))


__all__ = ["ClassifierFn", "PoolingParamsUpdate", "PoolingType", "ProjectorFn", "PromptLens",
           "parse_pooling_type", "pool_sequences", "split_tokens"]
