"""The native bf16 GEMV that decode-sized linears use (one row; up to GEMV_MAX_ROWS without
AMX): against fp32 maths and oneDNN, with bias, strided weights and rows of x, and the cases it
must leave to oneDNN."""

import pytest
import torch

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels.cpu_linear import cpu_linear, pack_for_cpu

pytestmark = pytest.mark.requires_native


@pytest.fixture(scope="module", autouse=True)
def _avx512_bf16():
    if not ops._has_gemv:
        pytest.skip("this CPU has no AVX-512 (the GEMV then stays unused)")


@pytest.mark.parametrize("n,k", [(576, 576), (1536, 576), (576, 1536), (7, 64), (4099, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_fp32_linear(n, k, with_bias, m):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k + 32, generator=gen).bfloat16()[:, 32:]     # rows k + 32 apart
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    assert ops.gemv_supported(x, w)
    y = ops.gemv_bf16(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # fp32 accumulation, one rounding to bf16: within one bf16 ulp of the exact result
    torch.testing.assert_close(y.float(), ref, atol=1e-3, rtol=8e-3)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):            # row groups split, and stolen, any way: the same rows
            torch.set_num_threads(count)
            assert torch.equal(ops.gemv_bf16(x, w, b), y)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [576, 96, 1536])
def test_each_row_is_the_one_row_product_whatever_the_row_count(k):
    """Batch invariance: the rows of a multi-row call sum in the one-row order, so a request's
    outputs do not depend on how many rows share its step (draft verification, batching)."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(8, k, generator=gen).bfloat16()
    w = (torch.randn(300, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(300, generator=gen).bfloat16()
    alone = torch.cat([ops.gemv_bf16(x[i:i + 1], w, b) for i in range(8)])
    for m in (2, 4, 5, 8):
        assert torch.equal(ops.gemv_bf16(x[:m], w, b), alone[:m]), m


def test_strided_weight_rows_and_unsupported_shapes():
    w_full = torch.randn(64, 128).bfloat16()
    w = w_full[:, :64]                                   # rows 128 apart: a column slice
    x = torch.randn(1, 64).bfloat16()
    torch.testing.assert_close(ops.gemv_bf16(x, w, None).float(),
                               (x.float() @ w.float().T), atol=1e-3, rtol=8e-3)
    assert not ops.gemv_supported(torch.randn(ops.GEMV_MAX_ROWS + 1, 64).bfloat16(), w)
    assert not ops.gemv_supported(torch.randn(0, 64).bfloat16(), w)
    assert not ops.gemv_supported(torch.randn(1, 48).bfloat16(), w_full[:, :48])  # K % 32
    assert not ops.gemv_supported(torch.randn(1, 64), w.float())           # fp32


def test_linear_layer_uses_gemv_for_decode_rows_only(monkeypatch):
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(96, 64).bfloat16(), requires_grad=False)
    pack_for_cpu(layer)
    layer.weight._amx_rows = 0            # as on a CPU without AMX: decode rows go to the GEMV
    calls = []
    real = ops.gemv_bf16
    monkeypatch.setattr(ops, "gemv_bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(ops.GEMV_MAX_ROWS + 1, 64).bfloat16()
    batched = cpu_linear(x, layer.weight, None)             # oneDNN
    assert calls == []
    some = cpu_linear(x[1:4], layer.weight, None)           # native GEMV
    assert calls == [3]
    torch.testing.assert_close(some.float(), batched[1:4].float(), atol=2e-2, rtol=2e-2)
