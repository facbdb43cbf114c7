"""The native bf16 row argmax behind plain-greedy sampling: torch's fp32 argmax, first index on
ties, any vocabulary size and row stride; other inputs are left to torch."""

import pytest
import torch

from minivllm import _custom_ops as ops


@pytest.mark.requires_native
def test_matches_fp32_argmax_with_ties_tails_and_strides():
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 15, 16, 33, 49152):
        x = torch.randn(9, vocab, generator=gen).bfloat16()
        x[0] = 0.0                                           # all equal: index 0
        if vocab > 20:
            x[1, 3] = x[1, vocab - 1] = 40.0                 # tie across lanes: the first
            x[2, vocab - 1] = 50.0                           # maximum in the scalar tail
            x[3, :] = float("-inf")
            x[3, vocab // 2] = -1e30
        got = ops.argmax_bf16(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.float().argmax(-1)), vocab
    wide = torch.randn(4, 100, generator=gen).bfloat16()
    view = wide[:, 10:90]                                   # rows 100 apart
    assert torch.equal(ops.argmax_bf16(view), view.float().argmax(-1))


def test_other_inputs_are_left_to_torch():
    assert ops.argmax_bf16(torch.randn(2, 8)) is None                       # fp32
    assert ops.argmax_bf16(torch.randn(8, 2).bfloat16().t()) is None         # column stride
    assert ops.argmax_bf16(torch.randn(8).bfloat16()) is None                # 1-D
