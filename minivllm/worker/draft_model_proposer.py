"""Draft-model speculation (vLLM's `draft_model` method): a small model of the same vocabulary
proposes the next tokens greedily; the target verifies them (worker/rejection_sampler.py).

The draft lives beside the target in the runner: its attention layers register in the same
static forward context under the prefix `draft_model.`, so the runner gives them KV caches
paged by the same block tables. Every step the draft runs the target's own inputs ("mirror"),
so its cache holds exactly the positions the target's holds (rejected drafts are rewritten
next step, for both). After sampling, it runs k one-token steps from each request's last token,
writing positions the scheduler reserved as lookahead slots (`num_lookahead_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from minivllm.config import VllmConfig
from minivllm.model_executor.model_loader import get_model
from minivllm.model_executor.model_loader.weight_utils import get_quant_config
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
        quant_config=get_quant_config(spec.draft_model_config, vllm_config.load_config,
                                      vllm_config.device_config.device),
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

    def bind_graphs(self, builder: Any, attn_layer_names: list[str]) -> None:
        """CPU graphs of the draft's own steps, against the KV cache just bound."""
        self.graphs = CPUGraphRunner(self.vllm_config, builder, attn_layer_names)

    def mirror(self, rows: StepInputs, inputs: StepInputs, with_drafts: bool) -> None:
        """The target's step through the draft: its KV cache follows the target's."""
        self.run_model(self.model, self.graphs, rows, inputs, None, with_drafts)

    def propose(self, req_ids: list[str], states: list[Any]) -> list[list[int]]:
        """Up to k greedy draft tokens per request (`states[i]`: token_ids, block_ids), fewer
        where its reserved slots or max_model_len end first."""
        last = [s.token_ids[-1] for s in states]
        pos = [len(s.token_ids) - 1 for s in states]
        room = [min(len(s.block_ids) * self.block_size, self.max_model_len) - p
                for s, p in zip(states, pos)]
        drafts: list[list[int]] = [[] for _ in states]
        alive = [i for i in range(len(states)) if room[i] > 0]
        for j in range(self.k):
            alive = [i for i in alive if j < room[i]]
            if not alive:
                break
            # NOTE: a loop over draft positions (k), each step one batched forward.
            step = decode_step_inputs([req_ids[i] for i in alive], [last[i] for i in alive],
                                      [pos[i] + j for i in alive],
                                      [states[i].block_ids for i in alive], self.block_size)
            hidden = self.run_model(self.model, self.graphs, step, step, None, False)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()   # [A]
            for i, token in zip(alive, tokens):
                drafts[i].append(token)
                last[i] = token
        return drafts

    def remove(self, req_ids: set[str]) -> None:
        """Nothing per request: the draft's KV lives in the requests' blocks."""
