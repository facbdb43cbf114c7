"""The native AMX GEMM that bf16 linears use for decode steps (and prompt chunks of small
weights): against fp32 maths, with bias, strided operands, ragged row counts (several 64-row
chunks), and the cases it must leave to others."""

import pytest
import torch

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels.cpu_linear import cpu_linear, pack_for_cpu

pytestmark = pytest.mark.requires_native


@pytest.fixture(scope="module", autouse=True)
def _amx():
    if not ops._has_amx:
        pytest.skip("this CPU (or kernel) offers no AMX: the GEMM then stays unused")


def _reference(x, w, b):
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 40, 64, 65, 130, 300])
@pytest.mark.parametrize("n,k", [(16, 32), (576, 576), (960, 576), (576, 1536), (4144, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_fp32_linear(m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 7919 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    assert ops.gemm_supports_weight(w)
    y = ops.gemm_bf16(x, w, b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # fp32 accumulation, one rounding to bf16: within one bf16 ulp of the exact result
    torch.testing.assert_close(y.float(), _reference(x, w, b), atol=1e-3, rtol=8e-3)


def test_strided_rows_and_thread_count_do_not_change_results():
    gen = torch.Generator().manual_seed(3)
    x_full = torch.randn(24, 160, generator=gen).bfloat16()
    w_full = (torch.randn(48, 192, generator=gen) * 0.05).bfloat16()
    x, w = x_full[:, :128], w_full[:, :128]          # rows 160 / 192 elements apart
    y = ops.gemm_bf16(x, w, None)
    torch.testing.assert_close(y.float(), _reference(x, w, None), atol=1e-3, rtol=8e-3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)                      # each output is one thread's sum, in order
        assert torch.equal(ops.gemm_bf16(x, w, None), y)
    finally:
        torch.set_num_threads(threads)


def test_unsupported_shapes_are_refused():
    w = torch.randn(64, 64).bfloat16()
    assert not ops.gemm_supports_weight(torch.randn(24, 64).bfloat16())     # N % 16
    assert not ops.gemm_supports_weight(torch.randn(64, 48).bfloat16())     # K % 32
    assert not ops.gemm_supports_weight(w.float())                          # fp32
    with pytest.raises(ValueError, match="M >= 1"):
        ops.gemm_bf16(torch.randn(0, 64).bfloat16(), w, None)


def _packed_layer(n: int, k: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k) * 0.05).bfloat16(), requires_grad=False)
    pack_for_cpu(layer)
    return layer


def test_linear_layer_routes_rows_to_gemm_gemv_or_onednn(monkeypatch):
    calls = []
    for name in ("gemm_bf16", "gemv_bf16"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    layer = _packed_layer(96, 64)
    assert layer.weight._amx_rows == ops.GEMM_PROMPT_ROWS          # small weight: prompts too
    x = torch.randn(ops.GEMM_PROMPT_ROWS + 1, 64).bfloat16()
    prefill = cpu_linear(x, layer.weight, None)                    # 1025 rows: oneDNN
    assert calls == []
    for rows in (1, 3, 64, 80, ops.GEMM_PROMPT_ROWS):               # AMX GEMM
        y = cpu_linear(x[:rows], layer.weight, None)
        torch.testing.assert_close(y.float(), prefill[:rows].float(), atol=2e-2, rtol=2e-2)
    assert calls == ["gemm_bf16"] * 5
    calls.clear()
    big = _packed_layer(4096, 576)                                  # over GEMM_PROMPT_WEIGHT
    assert big.weight._amx_rows == ops.GEMM_MAX_ROWS
    xb = torch.randn(80, 576).bfloat16()
    cpu_linear(xb[:64], big.weight, None)                          # decode-sized: AMX
    cpu_linear(xb, big.weight, None)                               # prompt: oneDNN
    assert calls == ["gemm_bf16"]
    calls.clear()
    odd = _packed_layer(40, 64)                        # N % 16 != 0: GEMV up to GEMV_MAX_ROWS
    assert odd.weight._amx_rows == 0
    cpu_linear(x[:1], odd.weight, None)
    cpu_linear(x[:ops.GEMV_MAX_ROWS], odd.weight, None)
    cpu_linear(x[:ops.GEMV_MAX_ROWS + 1], odd.weight, None)       # and oneDNN above
    assert calls == ["gemv_bf16"] * 2
