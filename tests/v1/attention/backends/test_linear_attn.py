"""`LinearAttentionMetadataBuilder`: vLLM's counts and names over the runner's state
metadata, for a batch mixing decodes, a prefill chunk and a fresh prompt in any order."""

import torch

from minivllm.v1.attention.backends.linear_attn import (BailingLinearAttentionBackend,
                                                         LinearAttentionBackend,
                                                         LinearAttentionMetadataBuilder)
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata
from minivllm.worker.state_slots import StateSlots


def test_builder_counts_decodes_and_prefills_in_batch_order():
    slots = StateSlots(4)
    # b: a decode after 9 tokens, a: a prompt chunk of 8 after 16, c: a fresh 5-token prompt
    qsl = torch.tensor([0, 1, 9, 14])
    state_md = slots.metadata(["b", "a", "c"], [9, 16, 0], qsl)
    md = LinearAttentionMetadataBuilder().build(state_md)
    assert (md.num_decodes, md.num_decode_tokens) == (1, 1)
    assert (md.num_prefills, md.num_prefill_tokens) == (2, 13)
    assert md.seq_lens.tolist() == [10, 24, 5]
    assert md.has_initial_state.tolist() == [True, True, False]
    assert torch.equal(md.state_indices_tensor, state_md.state_indices)
    assert md.state_indices is md.state_indices_tensor and md.num_reqs == 3


def test_builder_dummy_run_rows_start_from_zero():
    state_md = ShortConvAttentionMetadata(torch.tensor([0, 6]), torch.zeros(1, dtype=torch.long),
                                          torch.zeros(1, dtype=torch.bool), 6)
    md = LinearAttentionMetadataBuilder().build(state_md)
    assert md.seq_lens.tolist() == [6] and (md.num_prefills, md.num_decodes) == (1, 0)


def test_backend_names():
    assert LinearAttentionBackend.get_name() == "LINEAR_ATTN" and LinearAttentionBackend.is_ssm()
    assert BailingLinearAttentionBackend.get_name() == "BAILING_LINEAR_ATTN"
    assert BailingLinearAttentionBackend.get_builder_cls() is LinearAttentionMetadataBuilder
