"""Native bf16 RMSNorm (csrc/rms_norm.cpp) against torch.rms_norm, with and without the residual."""

import pytest
import torch

from minivllm import _custom_ops as ops

pytestmark = pytest.mark.requires_native


def _kernel_or_skip():
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    if ops.rms_norm_bf16(x, torch.ones(16, dtype=torch.bfloat16), 1e-6) is None:
        pytest.skip("no AVX-512 here: RMSNorm stays torch.rms_norm")


@pytest.mark.parametrize("d", [64, 100, 576, 2048])
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_matches_torch_rms_norm(d, scale):
    _kernel_or_skip()
    gen = torch.Generator().manual_seed(d)
    x_full = (torch.randn(200, d + 8, generator=gen) * scale).bfloat16()
    x = x_full[:, :d]                                        # rows d + 8 apart
    residual = (torch.randn(200, d, generator=gen) * scale).bfloat16()
    w = (torch.randn(d, generator=gen) * 0.5 + 1).bfloat16()
    ref = torch.rms_norm(x, [d], w, 1e-5)
    out = ops.rms_norm_bf16(x, w, 1e-5)
    # The fp32 sum of squares runs in another order than torch's: at most a last-bit difference,
    # in a few of 10^5 values.
    assert (out.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -7
    assert (out != ref).float().mean() < 1e-3
    summed = x + residual
    out2, new_residual = ops.rms_norm_bf16(x, w, 1e-5, residual)
    assert torch.equal(new_residual, summed)                  # the bf16-rounded sum, as eager
    assert (out2 != torch.rms_norm(summed, [d], w, 1e-5)).float().mean() < 1e-3


def test_declines_what_it_cannot_take():
    w = torch.ones(8, dtype=torch.bfloat16)
    assert ops.rms_norm_bf16(torch.randn(2, 8), w, 1e-6) is None             # fp32
    assert ops.rms_norm_bf16(torch.randn(2, 8).bfloat16().t(), w, 1e-6) is None  # strided rows
    x = torch.randn(2, 8).bfloat16()
    assert ops.rms_norm_bf16(x, w, 1e-6, torch.randn(2, 8)) is None          # fp32 residual


@pytest.mark.parametrize("tokens,heads,d", [(1, 9, 64), (7, 3, 64), (5, 4, 128)])
def test_head_views_of_a_fused_row_are_normed_in_place(tokens, heads, d):
    """q as Qwen3 sees it: [T, heads, d] viewed inside a wider qkv row (no copy); each head is
    its own row, equal to torch.rms_norm per head."""
    _kernel_or_skip()
    gen = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, heads * d + 2 * d, generator=gen).bfloat16()
    q = qkv[:, :heads * d].view(tokens, heads, d)              # strides (row, d, 1)
    w = (torch.randn(d, generator=gen) * 0.5 + 1).bfloat16()
    out = ops.rms_norm_bf16(q, w, 1e-6)
    assert out.shape == (tokens, heads, d) and out.is_contiguous()
    ref = torch.rms_norm(q.contiguous(), [d], w, 1e-6)
    assert (out.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -7
    assert (out != ref).float().mean() < 1e-2
    # one head wrong (e.g. a row read from the wrong offset) would show far above that bound
    assert ops.rms_norm_bf16(q, w, 1e-6, residual=torch.zeros_like(q)) is None  # no residual form
