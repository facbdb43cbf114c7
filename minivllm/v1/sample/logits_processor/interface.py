"""vLLM's batch-level logits processor interface (`vllm.v1.sample.logits_processor`).

A processor is built once per worker and sees the whole batch: each step it first learns how the
batch changed (`update_state`), then transforms the logits `[num_reqs, V]`, row i being the
request at batch index i. It keeps its own per-request settings (usually read from
`SamplingParams.extra_args`) keyed by batch index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.config import VllmConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()   # a -> b; index a is left empty
    SWAP = auto()             # a <-> b


# (batch index, params, prompt token ids, output token ids). The output list is the request's
# live list: it grows as the request generates, so a processor may keep the reference.
AddedRequest = tuple[int, SamplingParams, list[int], list[int]]
RemovedRequest = int                                     # batch index
MovedRequest = tuple[int, int, MoveDirectionality]       # (from, to, how)


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step. Apply in this order: removed, added, moved;
    an added or moved request may take the index of one that left."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for settings this processor cannot take (a request's
        `extra_args`); called before the request is queued, so it fails alone."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_reqs, V] float32 -> the transformed logits (in place is fine)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token has the largest logit: it then runs
        only for random sampling (after temperature), and greedy rows skip it."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called every step before `apply`; None when the batch did not change."""
        raise NotImplementedError
