"""vLLM's two conv entry points (`causal_conv1d_fn` for prefills, `causal_conv1d_update` for
decodes) over minivllm's varlen conv: channel-major inputs and vLLM's [slots, dim, K - 1] view
of the sequence-major states, as bailing_moe_v3.py's KDA layer calls them, against the varlen
conv itself."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.mamba.ops.causal_conv1d import (causal_conv1d_fn,
                                                                causal_conv1d_update,
                                                                causal_conv1d_varlen)
from tests.model_executor.layers.mamba.ops._varlen_batch import step_metadata


def test_prefill_then_update_equal_the_varlen_conv_through_vllms_state_view():
    torch.manual_seed(0)
    channels, k = 6, 4
    md = step_metadata()
    u, weight = torch.randn(md.num_actual_tokens, channels), torch.randn(channels, k)
    states = torch.randn(5, k - 1, channels)                # minivllm's sequence-major rows
    ref_states = states.clone()
    ref = F.silu(causal_conv1d_varlen(u, weight, None, ref_states, md))
    view = states.transpose(-1, -2)                          # vLLM's [slots, dim, K - 1]
    out = causal_conv1d_fn(u.transpose(0, 1), weight, None, conv_states=view,
                           query_start_loc=md.query_start_loc, cache_indices=md.state_indices,
                           has_initial_state=md.has_initial_state, activation="silu")
    torch.testing.assert_close(out.transpose(0, 1), ref)
    torch.testing.assert_close(states, ref_states)          # written through the view
    # one more token for every sequence, from the states just written
    step = torch.randn(len(md.state_indices), channels)
    decode_md = type(md)(torch.arange(len(step) + 1), md.state_indices,
                         torch.ones(len(step), dtype=torch.bool), len(step))
    ref_step = F.silu(causal_conv1d_varlen(step, weight, None, ref_states, decode_md))
    out_step = causal_conv1d_update(step, view, weight, None, activation="silu",
                                    conv_state_indices=md.state_indices)
    torch.testing.assert_close(out_step, ref_step)
    torch.testing.assert_close(states, ref_states)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_update(step, view, weight, activation="gelu",
                             conv_state_indices=md.state_indices)
