"""Counters of speculative decoding (vLLM's SpecDecodingStats), kept by the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Totals since the engine started: drafts verified, draft tokens, accepted tokens, and
    acceptances per draft position (position 0: the first draft token of a step)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified step yields on average: the accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
