"""`GDNAttentionMetadata` from the runner's state metadata: a row is a decode only when it
brings one token on top of a saved state (a one-token prompt is a prefill, which zeroes its
state), and the backend enum resolves to the builder."""

import torch

from minivllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
from minivllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


def test_one_token_rows_with_a_state_are_decodes():
    # rows: a 5-token prompt, a decode, a one-token prompt (no state), a 3-token chunk
    qsl = torch.tensor([0, 5, 6, 7, 10])
    state = ShortConvAttentionMetadata(qsl, torch.tensor([2, 0, 3, 1]),
                                       torch.tensor([False, True, False, True]), 10)
    backend = MambaAttentionBackendEnum.GDN_ATTN.get_class()
    assert backend is GDNAttentionBackend and backend.get_name() == "GDN_ATTN"
    md = backend.get_builder_cls()().build(state)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.num_prefill_tokens) == \
        (1, 1, 3, 9)
    assert md.num_actual_tokens == 10 and md.num_spec_decodes == 0
    assert md.spec_sequence_masks is None and md.spec_query_start_loc is None
    assert torch.equal(md.non_spec_query_start_loc, qsl)
    assert torch.equal(md.non_spec_state_indices_tensor, torch.tensor([2, 0, 3, 1]))
