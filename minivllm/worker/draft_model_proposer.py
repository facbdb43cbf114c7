"""Draft-model speculation (vLLM's `draft_model` method): a small model of the same vocabulary
proposes the next tokens greedily; the target verifies them (worker/rejection_sampler.py).

The draft lives beside the target in the runner: its attention layers register in the same
static forward context under the prefix `draft_model.`, so the runner gives them KV caches
paged by the same block tables. In prompt and mixed steps the draft runs the target's own
inputs ("mirror"); in decode steps it does not, and after sampling it catches up from what it
wrote itself (its own drafts, where the target accepted them) to the last known token, then
runs k - 1 one-token steps, writing positions the scheduler reserved as lookahead slots
(`num_lookahead_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from minivllm.config import VllmConfig
from minivllm.model_executor.model_loader import get_model
from minivllm.worker.cpu_graph_runner import CPUGraphRunner
from minivllm.worker.input_batch import StepInputs, decode_step_inputs

DRAFT_PREFIX = "draft_model"
# run_model(model, graphs, rows, inputs, intermediate_tensors, with_drafts) -> hidden [T, H]
RunModel = Callable[..., torch.Tensor]


def draft_vllm_config(vllm_config: VllmConfig) -> VllmConfig:
    """The target's config with the draft's model (and its quantization): the same compilation
    config object, so the draft's layers join the target's static forward context; a cache
    config of its own, whose model-wide window (if any) is the draft's."""
    spec = vllm_config.speculative_config
    return dataclasses.replace(
        vllm_config, model_config=spec.draft_model_config,
        cache_config=dataclasses.replace(vllm_config.cache_config, sliding_window=None),
        quant_config=spec.draft_quant_config,
        lora_config=None)


class DraftModelProposer:
    """Loads the draft, mirrors the target's steps, proposes k greedy tokens per request."""

    def __init__(self, vllm_config: VllmConfig, run_model: RunModel) -> None:
        self.vllm_config = draft_vllm_config(vllm_config)
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        self.run_model = run_model
        self.model = get_model(vllm_config=self.vllm_config, prefix=DRAFT_PREFIX)
        self.graphs: CPUGraphRunner | None = None
        # req_id -> end of the positions the draft wrote (from 0, no gap) into its cache
        self.written: dict[str, int] = {}

    def bind_graphs(self, builder: Any, attn_layer_names: list[str]) -> None:
        """CPU graphs of the draft's own steps, against the KV cache just bound."""
        self.graphs = CPUGraphRunner(self.vllm_config, builder, attn_layer_names)

    def mirror(self, rows: StepInputs, inputs: StepInputs, with_drafts: bool) -> None:
        """The target's step through the draft, so its cache follows the target's; skipped when
        every request (known to the draft) runs its last token and drafts: `propose` then
        catches up the few positions the draft lacks."""
        if with_drafts and all(r in self.written for r in inputs.req_ids):
            return
        self.run_model(self.model, self.graphs, rows, inputs, None, with_drafts)
        for req_id, start, n in zip(inputs.req_ids, inputs.num_computed, inputs.query_lens):
            self.written[req_id] = start + n

    def propose(self, req_ids: list[str], states: list[Any]) -> list[list[int]]:
        """Up to k greedy draft tokens per request (`states[i]`: token_ids, block_ids), fewer
        where its reserved slots or max_model_len end first.

        The draft's cache holds the real tokens below min(written, N - 1) (N: known tokens):
        what it wrote beyond, its own rejected drafts, is stale. The first forward catches up
        from there to the last known token (1 or 2 rows a request), the next k - 1 feed one
        draft each."""
        known = [len(s.token_ids) for s in states]
        room = [min(len(s.block_ids) * self.block_size, self.max_model_len) - (n - 1)
                for s, n in zip(states, known)]
        alive = [i for i in range(len(states)) if room[i] > 0]
        drafts: list[list[int]] = [[] for _ in states]
        if not alive:
            return drafts
        starts = [min(self.written.get(req_ids[i], known[i] - 1), known[i] - 1) for i in alive]
        rows = [(i, p) for i, start in zip(alive, starts) for p in range(start, known[i])]
        tokens = self._greedy_next(req_ids, states, [(i, p, states[i].token_ids[p])
                                                     for i, p in rows], last_of=alive)
        for j in range(self.k):
            for i, token in zip(alive, tokens):
                drafts[i].append(token)
                self.written[req_ids[i]] = known[i] + j
            alive = [i for i in alive if j + 1 < room[i]]
            if j + 1 == self.k or not alive:
                break
            # NOTE: a loop over draft positions (k), each step one batched forward.
            tokens = self._greedy_next(req_ids, states, [(i, known[i] - 1 + j + 1,
                                                          drafts[i][-1]) for i in alive])
        return drafts

    def _greedy_next(self, req_ids: list[str], states: list[Any],
                     rows: list[tuple[int, int, int]], last_of: list[int] | None = None
                     ) -> list[int]:
        """One draft forward over rows (request index, position, token), each row a one-token
        sequence of its own length; the argmax at each request's last row (in `last_of` order,
        else every row's)."""
        step = decode_step_inputs([req_ids[i] for i, _, _ in rows], [t for _, _, t in rows],
                                  [p for _, p, _ in rows],
                                  [states[i].block_ids for i, _, _ in rows], self.block_size)
        hidden = self.run_model(self.model, self.graphs, step, step, None, False)
        if last_of is not None:
            last_row = {i: r for r, (i, _, _) in enumerate(rows)}
            hidden = hidden[[last_row[i] for i in last_of]]
        # fp32 first: torch's bf16 argmax over a [1, 49152] row takes 3x as long (~180 us)
        return self.model.compute_logits(hidden).float().argmax(dim=-1).tolist()

    def remove(self, req_ids: set[str]) -> None:
        """Forgets finished and preempted requests (a resumed one is mirrored afresh)."""
        for req_id in req_ids:
            self.written.pop(req_id, None)
