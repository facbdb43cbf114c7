"""The varlen causal depthwise conv (`ops/causal_conv1d.py`) against a per-sequence conv over
each sequence's state rows followed by its tokens; the last K - 1 inputs written back."""

import torch

from minivllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_varlen
from tests.model_executor.layers.mamba.ops._varlen_batch import (HAS_STATE, LENS, SLOTS,
                                                                 step_metadata)


def test_varlen_conv_matches_a_per_sequence_conv():
    torch.manual_seed(1)
    channels, k, total = 6, 4, sum(LENS)
    u, weight, bias = torch.randn(total, channels), torch.randn(channels, k), torch.randn(channels)
    state = torch.randn(5, k - 1, channels)
    md = step_metadata()
    out_state = state.clone()
    y = causal_conv1d_varlen(u, weight, bias, out_state, md)
    for i in range(len(LENS)):
        lo, hi = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        history = state[SLOTS[i]] if HAS_STATE[i] else torch.zeros(k - 1, channels)
        ext = torch.cat([history, u[lo:hi]])                       # [K - 1 + L, C]
        ref = torch.stack([(ext[t:t + k] * weight.T).sum(0) for t in range(hi - lo)]) + bias
        torch.testing.assert_close(y[lo:hi], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_state[SLOTS[i]], ext[-(k - 1):])
