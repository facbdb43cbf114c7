"""The model runner's pooling step: prompts' hidden states (gathered over chunks) -> the pooler.

A pooling request is prompt-only. While its prompt is prefilled in chunks, each chunk's hidden
states are kept here; the step that computes its last prompt token pools the whole prompt at
once, so MEAN / CLS / ALL over a chunked prompt equal the unchunked result. That step answers a
placeholder token for the request: the engine gives pooling requests `max_tokens=1`, so the
scheduler finishes them (and frees their KV blocks) exactly as after a first sampled token.
"""

from collections.abc import Callable, Iterable

import numpy as np
import torch

from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.worker.input_batch import StepInputs

# The token a pooling request "samples" when pooled: never decoded, only ends the request.
PLACEHOLDER_TOKEN_ID = 0


class PoolingRunner:
    """Per-request hidden states of prompts still being prefilled, and the pooling of a step."""

    def __init__(self, pooler: Callable[[torch.Tensor, list[int]], torch.Tensor | list[torch.Tensor]]
                 ) -> None:
        self.pooler = pooler
        self.chunks: dict[str, list[torch.Tensor]] = {}   # req_id -> [n_chunk, H] pieces

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget finished / preempted requests (a preempted one restarts from its first token)."""
        for req_id in req_ids:
            self.chunks.pop(req_id, None)

    def pool(self, inputs: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        """Pools every request whose chunk ends its prompt; keeps the others' chunks.

        `hidden` is `[T, H]` for the step's T tokens, request b's rows at
        `query_start_loc[b] : query_start_loc[b] + query_lens[b]`.
        """
        finishing = set(inputs.sample_rows)
        starts = inputs.query_start_loc.tolist()
        pieces: list[torch.Tensor] = []
        lens: list[int] = []
        for b, req_id in enumerate(inputs.req_ids):
            # NOTE: a loop over requests, not tokens: each owns a contiguous row range.
            chunk = hidden[starts[b]:starts[b] + inputs.query_lens[b]]
            if b not in finishing:
                # A clone: `hidden` may be a CPU graph's static buffer, rewritten next step.
                self.chunks.setdefault(req_id, []).append(chunk.clone())
                continue
            earlier = self.chunks.pop(req_id, [])
            pieces.extend(earlier + [chunk])
            lens.append(sum(len(p) for p in earlier) + len(chunk))
        pooled_rows: dict[str, np.ndarray] = {}
        if lens:
            pooled = self.pooler(torch.cat(pieces), lens)       # [B', H] or B' x [n_i, H]
            rows = pooled if isinstance(pooled, list) else list(pooled)
            finished_ids = [inputs.req_ids[b] for b in sorted(finishing)]
            # NOTE: numpy, so that outputs pickle by value from worker processes.
            pooled_rows = {req_id: row.float().cpu().numpy()
                           for req_id, row in zip(finished_ids, rows)}
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[[PLACEHOLDER_TOKEN_ID] if r in pooled_rows else []
                               for r in inputs.req_ids],
            pooler_output=[pooled_rows.get(r) for r in inputs.req_ids])
