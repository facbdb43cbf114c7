"""Per-step metadata of the Gated DeltaNet / Kimi Delta Attention layers that vLLM's model
files drive themselves (vLLM's `gdn_attn.py`): vLLM's field names over the runner's state
metadata (`short_conv_attn.py`).

A row is a decode when it brings one token on top of a saved state; every other row (a
prompt, a prompt chunk, a one-token prompt) is a prefill, which reads its state only when it
has one. minivllm's runner does not move decodes to the front as vLLM's does: the files run
all rows through the prefill path whenever a step has a prefill, and the ops take rows in any
order. No speculative decoding: the spec_* fields are None.
"""

from dataclasses import dataclass

import torch

from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


class GDNAttentionBackend:
    """Names the backend as vLLM does; the states live on the layers."""

    @staticmethod
    def get_name() -> str:
        return "GDN_ATTN"

    @staticmethod
    def get_builder_cls() -> type["GDNAttentionMetadataBuilder"]:
        return GDNAttentionMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


@dataclass
class GDNAttentionMetadata:
    """Sequences in batch order; sequence i owns token rows query_start_loc[i]:[i+1]."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_spec_decodes: int
    num_spec_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor | None           # bool [B]
    non_spec_query_start_loc: torch.Tensor | None    # int64 [B + 1]
    non_spec_state_indices_tensor: torch.Tensor | None   # int64 [B], the state slots
    spec_query_start_loc: torch.Tensor | None = None
    spec_state_indices_tensor: torch.Tensor | None = None
    spec_sequence_masks: torch.Tensor | None = None
    spec_token_indx: torch.Tensor | None = None
    non_spec_token_indx: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None


class GDNAttentionMetadataBuilder:
    """Builds a step's `GDNAttentionMetadata` from the runner's state metadata."""

    reorder_batch_threshold: int = 1

    def build(self, state_metadata: ShortConvAttentionMetadata) -> GDNAttentionMetadata:
        qsl = state_metadata.query_start_loc
        query_lens = qsl[1:] - qsl[:-1]                                  # [B]
        is_decode = (query_lens == 1) & state_metadata.has_initial_state
        num_decodes = int(is_decode.sum())
        return GDNAttentionMetadata(
            num_prefills=query_lens.numel() - num_decodes,
            num_prefill_tokens=state_metadata.num_actual_tokens - num_decodes,
            num_decodes=num_decodes, num_decode_tokens=num_decodes, num_spec_decodes=0,
            num_spec_decode_tokens=0, num_actual_tokens=state_metadata.num_actual_tokens,
            has_initial_state=state_metadata.has_initial_state,
            non_spec_query_start_loc=qsl,
            non_spec_state_indices_tensor=state_metadata.state_indices)
