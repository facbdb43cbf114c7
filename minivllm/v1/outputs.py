"""What the model runner answers the scheduler each step (vLLM keeps it in `v1/outputs.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# (token_id, logprob, rank): rank 1 is the most likely token.
LogprobEntry = tuple[int, float, int]


@dataclass
class ModelRunnerOutput:
    """The runner's answer to one `SchedulerOutput`."""

    req_ids: list[str]                     # requests of this step, in order
    # [] for a partial prefill, else [token]; with draft tokens the accepted drafts and then
    # the target's own next token (1 to num_drafts + 1 tokens)
    sampled_token_ids: list[list[int]]
    # Per request, one list per sampled token: that token then the top-k; None for a request
    # that did not ask, and None when no request of the step asked.
    logprobs: list[list[list[LogprobEntry]] | None] | None = None
    # req_id -> one list per prompt position computed this step (the first prompt token has
    # none), each: the actual next prompt token first, then the top-k.
    prompt_logprobs: dict[str, list[list[LogprobEntry]]] = field(default_factory=dict)
    # Pooling models: per request, its pooled output once its whole prompt ran (`[H]` or
    # `[n, H]` float32), else None. NOTE: numpy, so it pickles by value from worker processes.
    pooler_output: list[np.ndarray | None] | None = None
    # Speculative decoding: per request, the draft tokens proposed for its next step ([] for
    # none); None when the engine does not speculate.
    spec_token_ids: list[list[int]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
