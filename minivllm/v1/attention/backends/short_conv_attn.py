"""Per-step metadata of recurrent-state layers (vLLM's `ShortConvAttentionMetadata`): where each
scheduled sequence's state lives and whether it starts from one.

Built once per step by the model runner from its state slots (`worker/state_slots.py`) and
published in the forward context (`state_metadata`); every state layer of the model reads it.
"""

from dataclasses import dataclass

import torch


@dataclass
class ShortConvAttentionMetadata:
    """Sequences in batch order; sequence i owns token rows query_start_loc[i]:[i+1]."""

    query_start_loc: torch.Tensor    # int64 [B+1]
    state_indices: torch.Tensor      # int64 [B], the state slot of each sequence
    has_initial_state: torch.Tensor  # bool [B], False: the sequence starts here (zero state)
    num_actual_tokens: int
    # int64 [B], computed + scheduled tokens of each sequence (vLLM's seq_lens); None in a
    # dummy run, which has no sequences.
    seq_lens: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return self.state_indices.shape[0]

    @property
    def token_rows(self) -> torch.Tensor:
        """int64 [T]: the sequence (batch row) of every token."""
        q_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        return torch.repeat_interleave(torch.arange(self.num_reqs), q_lens)
