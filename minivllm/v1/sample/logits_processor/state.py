"""The batch the custom logits processors see: vLLM's persistent-batch indices, kept apart from
the sampler's row order.

minivllm's sampler takes the rows in whatever order a step schedules them; vLLM's processors
expect each request to keep one batch index while it stays in the batch, with changes reported
as `BatchUpdate`s. `LogitsProcessorBatch` keeps that layout (a request that leaves frees its
index, new requests fill the lowest free ones, the last entries move down into holes, as vLLM's
input batch condenses) and permutes the logits rows into it and back around the processors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from minivllm.sampling_params import SamplingParams
from minivllm.v1.sample.logits_processor.interface import (BatchUpdate, LogitsProcessor,
                                                           MoveDirectionality)

T = TypeVar("T")


class LogitsProcessors:
    """The loaded processors, split as the sampler runs them: the argmax-invariant ones only
    for random sampling (after temperature), the others before penalties."""

    def __init__(self, processors: Iterable[LogitsProcessor] = ()) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for p in processors:
            (self.argmax_invariant if p.is_argmax_invariant()
             else self.non_argmax_invariant).append(p)

    @property
    def all(self) -> list[LogitsProcessor]:
        return [*self.non_argmax_invariant, *self.argmax_invariant]


@dataclass
class LogitsProcsStep:
    """One step's processors and the row order they take: `order[i]` is the logits row of the
    request at batch index i (None: the same order)."""

    processors: LogitsProcessors
    order: torch.Tensor | None   # [B] int64

    def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
        """logits [B, V] float32 through the invariant (or the other) processors."""
        procs = (self.processors.argmax_invariant if argmax_invariant
                 else self.processors.non_argmax_invariant)
        if not procs:
            return logits
        batch = logits if self.order is None else logits.index_select(0, self.order)
        for proc in procs:
            batch = proc.apply(batch)
        if self.order is None:
            return batch
        return torch.empty_like(batch).index_copy_(0, self.order, batch)


class LogitsProcessorBatch:
    """The requests a runner holds, for its processors: params, prompt and the live output list
    of each, and the batch index of those in the current batch."""

    def __init__(self, processors: LogitsProcessors) -> None:
        self.processors = processors
        self._requests: dict[str, tuple[SamplingParams, list[int], list[int]]] = {}
        self._slots: list[str | None] = []   # batch index -> request id
        self._index: dict[str, int] = {}

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> None:
        self._requests[req_id] = (params, list(prompt_token_ids), list(output_token_ids))

    def remove_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)   # its batch index is freed by the next `step`

    def append_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        for req_id, token in zip(req_ids, token_ids):
            self._requests[req_id][2].append(token)

    def step(self, req_ids: list[str]) -> LogitsProcsStep:
        """Lays out this step's batch (the requests of logits rows `req_ids`), tells every
        processor how it changed, and returns what the sampler applies."""
        wanted = set(req_ids)
        removed = [i for i, r in enumerate(self._slots) if r is not None and r not in wanted]
        for i in removed:
            del self._index[self._slots[i]]
            self._slots[i] = None
        added = [self._place(r) for r in req_ids if r not in self._index]
        moved = self._condense()
        update = BatchUpdate(len(self._slots), removed, added, moved) \
            if removed or added or moved else None
        for proc in self.processors.all:
            proc.update_state(update)
        row_of = {r: i for i, r in enumerate(req_ids)}
        order = [row_of[r] for r in self._slots]
        identity = order == list(range(len(order)))
        return LogitsProcsStep(self.processors, None if identity else torch.tensor(order))

    def _place(self, req_id: str) -> tuple[int, SamplingParams, list[int], list[int]]:
        index = next((i for i, r in enumerate(self._slots) if r is None), len(self._slots))
        if index == len(self._slots):
            self._slots.append(None)
        self._slots[index] = req_id
        self._index[req_id] = index
        params, prompt, output = self._requests[req_id]
        return index, params, prompt, output

    def _condense(self) -> list[tuple[int, int, MoveDirectionality]]:
        """Moves the last requests into the holes below them: indices stay 0..B-1."""
        moved = []
        while True:
            while self._slots and self._slots[-1] is None:
                self._slots.pop()
            hole = next((i for i, r in enumerate(self._slots) if r is None), None)
            if hole is None:
                return moved
            last = len(self._slots) - 1
            req_id = self._slots[last]
            self._slots[hole], self._slots[last] = req_id, None
            self._index[req_id] = hole
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))


def process_dict_updates(entries: dict[int, T], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int], list[int]], T | None]
                         ) -> bool:
    """vLLM's helper for processors that keep one entry per batch index: applies a
    BatchUpdate to `entries` (an added request gets `new_state(params, prompt, output)`, or no
    entry when that is None). True when `entries` changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= entries.pop(index, None) is not None
    for index, params, prompt, output in batch_update.added:
        state: Any = new_state(params, prompt, output)
        if state is not None:
            entries[index] = state
            changed = True
        else:
            changed |= entries.pop(index, None) is not None
    for a, b, how in batch_update.moved:
        moving_a, moving_b = entries.pop(a, None), entries.pop(b, None)
        if moving_a is not None:
            entries[b] = moving_a
        if how == MoveDirectionality.SWAP and moving_b is not None:
            entries[a] = moving_b
        changed |= moving_a is not None or moving_b is not None
    return changed
