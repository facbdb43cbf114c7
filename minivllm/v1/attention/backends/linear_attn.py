"""Per-step metadata of the lightning / linear-attention layers (vLLM's `linear_attn.py`):
vLLM's field names over the runner's state metadata (`short_conv_attn.py`).

minivllm's runner does not move decodes to the front of the batch as vLLM's does, so the
counts say how many rows of each kind there are, not where they sit: a row with one scheduled
token is a decode, any longer row a prefill (or a prefill chunk). The ops take the rows in any
order (`layers/lightning_attn.py`).
"""

from dataclasses import dataclass

import torch

from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


class LinearAttentionBackend:
    """Names the backend as vLLM does; the state lives on the layer (a recurrent state, no
    paged KV cache), so there is no cache shape or impl class to give."""

    @staticmethod
    def get_name() -> str:
        return "LINEAR_ATTN"

    @staticmethod
    def get_builder_cls() -> type["LinearAttentionMetadataBuilder"]:
        return LinearAttentionMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


class BailingLinearAttentionBackend(LinearAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "BAILING_LINEAR_ATTN"


@dataclass
class LinearAttentionMetadata:
    """Sequences in batch order; sequence i owns token rows query_start_loc[i]:[i+1]."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    query_start_loc: torch.Tensor       # int64 [B+1]
    seq_lens: torch.Tensor              # int64 [B], computed + scheduled tokens
    state_indices_tensor: torch.Tensor  # int64 [B], the state slot of each sequence
    has_initial_state: torch.Tensor     # bool [B], False: zero state (seq_lens == query len)

    @property
    def state_indices(self) -> torch.Tensor:
        """The name the varlen ops read (`ShortConvAttentionMetadata`'s)."""
        return self.state_indices_tensor

    @property
    def num_reqs(self) -> int:
        return self.state_indices_tensor.shape[0]


# vLLM's Bailing variant adds speculative-decoding fields; minivllm runs these layers without
# speculation, so it is the same record.
BailingLinearAttentionMetadata = LinearAttentionMetadata


class LinearAttentionMetadataBuilder:
    """Builds a step's `LinearAttentionMetadata` from the runner's state metadata."""

    reorder_batch_threshold: int = 1

    def build(self, state_metadata: ShortConvAttentionMetadata) -> LinearAttentionMetadata:
        qsl = state_metadata.query_start_loc
        query_lens = qsl[1:] - qsl[:-1]                                  # [B]
        is_decode = query_lens <= self.reorder_batch_threshold
        seq_lens = state_metadata.seq_lens
        if seq_lens is None:                # a dummy run: every row starts from a zero state
            seq_lens = query_lens
        num_decode_tokens = int(query_lens[is_decode].sum())
        return LinearAttentionMetadata(
            num_prefills=int((~is_decode).sum()),
            num_prefill_tokens=state_metadata.num_actual_tokens - num_decode_tokens,
            num_decodes=int(is_decode.sum()), num_decode_tokens=num_decode_tokens,
            query_start_loc=qsl, seq_lens=seq_lens,
            state_indices_tensor=state_metadata.state_indices,
            has_initial_state=state_metadata.has_initial_state)


BailingLinearAttentionMetadataBuilder = LinearAttentionMetadataBuilder
