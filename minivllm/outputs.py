"""What the engine returns for a request, shaped like vLLM's `RequestOutput` and
`PoolingRequestOutput` / `EmbeddingRequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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


def _one_vector(output: PoolingOutput, what: str) -> list[float]:
    if output.data.ndim != 1:
        raise ValueError(f"{what} is one vector, but the pooler gave shape "
                         f"{tuple(output.data.shape)} (token-wise pooling: use LLM.encode)")
    return output.data.tolist()


@dataclass
class EmbeddingOutput:
    """One embedding vector as floats."""

    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        return EmbeddingOutput(_one_vector(output, "An embedding"))

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (logits with `use_activation=False`)."""

    probs: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> ClassificationOutput:
        return ClassificationOutput(_one_vector(output, "A classification"))

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class _TaskRequestOutput:
    """A `PoolingRequestOutput` whose `outputs` is read as one task's output type."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    output_type: ClassVar[Any] = None

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> Any:
        return cls(output.request_id, cls.output_type.from_base(output.outputs),
                   output.prompt_token_ids, output.finished, output.num_cached_tokens)


@dataclass
class EmbeddingRequestOutput(_TaskRequestOutput):
    """The vector as `outputs.embedding` (vLLM's embed result)."""
    output_type: ClassVar[Any] = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(_TaskRequestOutput):
    """The class probabilities as `outputs.probs` (vLLM's classify result)."""
    output_type: ClassVar[Any] = ClassificationOutput


@dataclass
class ScoringOutput:
    """The relevance of one (text_1, text_2) pair: a cross-encoder's probability, or the
    cosine similarity of two embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]   # the pair's ids (cross-encoder); text_2's (embeddings)
    finished: bool = True
