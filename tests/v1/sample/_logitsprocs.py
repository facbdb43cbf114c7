"""Custom logits processors the tests load by class and by 'module:Class' name (importable from
worker processes too)."""

from __future__ import annotations

import torch

from minivllm.sampling_params import SamplingParams
from minivllm.v1.sample.logits_processor import (AdapterLogitsProcessor, BatchUpdate,
                                                 LogitsProcessor, process_dict_updates)


class TargetTokenProcessor(LogitsProcessor):
    """vLLM's example: a request with extra_args {"target_token": t} can only produce t."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or isinstance(target, bool)):
            raise ValueError(f"target_token must be a token id (an int), got {target!r}.")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.targets: dict[int, int] = {}   # batch index -> token id

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.targets, batch_update,
                             lambda params, _, __: (params.extra_args or {}).get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        rows = torch.tensor(list(self.targets))
        cols = torch.tensor(list(self.targets.values()))
        kept = logits[rows, cols]
        logits[rows] = float("-inf")
        logits[rows, cols] = kept
        return logits


class NoRepeatProcessor(AdapterLogitsProcessor):
    """A per-request function of (prompt ids, output ids, row): with extra_args
    {"no_repeat": True}, no token of the prompt or of the output so far comes again."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("no_repeat"):
            return None

        def ban_seen(prompt_ids: list[int], output_ids: list[int],
                     row: torch.Tensor) -> torch.Tensor:
            row[list(set(prompt_ids) | set(output_ids))] = float("-inf")
            return row
        return ban_seen


class CountingInvariantProcessor(LogitsProcessor):
    """Argmax-invariant and harmless: counts the rows it was applied to (class-wide)."""

    rows_seen = 0

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).rows_seen += logits.shape[0]
        return logits


class NotAProcessor:
    pass
