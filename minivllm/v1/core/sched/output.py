"""What the scheduler tells the model runner each step (vLLM keeps it in `v1/core/sched/output.py`).

The engine writes it and the worker reads it, so it lives below both packages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minivllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]          # tokens already generated (non-empty only when resumed)
    sampling_params: SamplingParams
    block_ids: list[int]                 # the whole block table
    num_computed_tokens: int             # tokens whose KV is already in the cache
    lora_request: Any = None             # a LoRARequest, or None for the base model
    prompt_embeds: Any = None            # [L, H] tensor: the prompt given as embeddings


@dataclass
class CachedRequestData:
    """Requests the runner already holds; all lists are in the same order."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)   # appended to the table this step
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class GrammarOutput:
    """The token bitmask of the structured-output requests that sample this step.

    With draft tokens a request samples at several positions: its id then appears once per
    position, in position order (row of its k-th occurrence: the mask after k drafts).
    """

    structured_output_request_ids: list[str]   # row i of grammar_bitmask
    # [len(ids), ceil(V / 32)] int32; bit t of word w allows 32w + t. NOTE: numpy, as vLLM's,
    # so it pickles by value to worker processes (a torch tensor would travel by shared memory).
    grammar_bitmask: np.ndarray


@dataclass
class SchedulerOutput:
    """One step's work.

    NOTE: a request feeds `all_token_ids[num_computed_tokens : num_computed_tokens +
    num_scheduled_tokens[req_id]]`; the runner samples only when that chunk reaches the last
    known token. A step may schedule nothing: the runner must still drop the finished and
    preempted requests and answer an empty `ModelRunnerOutput`.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]   # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]             # finished/aborted since last step: drop their state
    preempted_req_ids: set[str]            # drop their state too; they come back as new requests
    grammar_output: GrammarOutput | None = None   # None when no constrained request samples
    # Speculative decoding: req_id -> the draft tokens scheduled after its last known token
    # (they are part of num_scheduled_tokens); the runner verifies them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
