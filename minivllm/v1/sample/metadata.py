"""vLLM's `SamplingMetadata` (`vllm/v1/sample/metadata.py`): one step's sampling knobs as batch
tensors, built by `worker/sampler.RequestSamplingStates.make_metadata`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.v1.sample.logits_processor.state import LogitsProcsStep


@dataclass
class SamplingMetadata:
    """Per-step batch tensors of the sampling knobs; row i is `req_ids[i]` of `make_metadata`.

    Optional tensors are None when no row of the batch needs them, so the sampler can skip
    whole stages with a Python check instead of a device sync.
    """

    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None           # [B] bool; None unless greedy and random rows mix
    temperature: torch.Tensor | None         # [B] float32, 1.0 on greedy rows; None if all greedy
    top_p: torch.Tensor | None               # [B] float32
    top_k: torch.Tensor | None               # [B] int64, vocab size where off
    min_p: torch.Tensor | None               # [B] float32
    generators: dict[int, torch.Generator]   # row -> generator of a seeded request
    max_num_logprobs: int | None             # largest `logprobs` asked in the batch
    num_logprobs: list[int | None]           # per row, to cut the top-k lists
    no_penalties: bool
    prompt_token_mask: torch.Tensor | None   # [B, V] bool: token occurs in the prompt
    output_token_counts: torch.Tensor | None  # [B, V] int32: occurrences in the output
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    min_tokens_mask_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token_ids) to mask
    # (rows, token_ids, biases) of every logit_bias entry of the batch, added in one op
    logit_bias_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Structured outputs: bitmask row i [W] int32 constrains logits row grammar_rows[i]
    grammar_bitmask: torch.Tensor | None = None   # [C, ceil(V / 32)] int32
    grammar_rows: torch.Tensor | None = None      # [C] int64
    # allowed_token_ids: rows [R] int64 and their allowed tokens [R, V] bool
    allowed_token_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # bad_words: (rows, token_ids) [N] int64 pairs to ban this step
    bad_words_mask_index: tuple[torch.Tensor, torch.Tensor] | None = None
    # custom logits processors (vLLM's), with this step's batch layout
    logitsprocs: LogitsProcsStep | None = None

    @property
    def greedy_bans_only(self) -> bool:
        """Greedy rows only, and nothing but -inf bans changes or reports the logits."""
        return (self.all_greedy and self.max_num_logprobs is None and self.no_penalties
                and self.logit_bias_index is None and not self._changing_logitsprocs)

    @property
    def plain_greedy(self) -> bool:
        """Greedy rows only and nothing that changes or reports the logits."""
        return (self.all_greedy and self.max_num_logprobs is None and self.no_penalties
                and self.min_tokens_mask_index is None and self.logit_bias_index is None
                and self.grammar_bitmask is None and self.allowed_token_mask is None
                and self.bad_words_mask_index is None and not self._changing_logitsprocs)

    @property
    def _changing_logitsprocs(self) -> bool:
        """Custom processors that may change a greedy row's argmax are loaded."""
        return self.logitsprocs is not None and \
            bool(self.logitsprocs.processors.non_argmax_invariant)
