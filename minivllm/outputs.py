"""What the engine returns for a request, shaped like vLLM's `RequestOutput` and
`PoolingRequestOutput` / `EmbeddingRequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Logprob:
    """One token's log probability; rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: the sampled token and the top-k, keyed by token id.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token, None for the first one (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None   # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request after a step: cumulative text and tokens of every completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0   # prompt tokens served from the prefix cache


@dataclass
class PoolingOutput:
    """A pooling model's output for one prompt: `[H]` (one vector) or `[n, H]` (per token)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The final output of a pooling request (pooling requests have no partial outputs)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    """One embedding vector as floats."""

    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        if output.data.ndim != 1:
            raise ValueError(f"An embedding is one vector, but the pooler gave shape "
                             f"{tuple(output.data.shape)} (token-wise pooling: use LLM.encode)")
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """`PoolingRequestOutput` with the vector as `outputs.embedding` (vLLM's embed result)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0

    @staticmethod
    def from_base(output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(output.request_id, EmbeddingOutput.from_base(output.outputs),
                                      output.prompt_token_ids, output.finished,
                                      output.num_cached_tokens)
