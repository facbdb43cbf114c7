"""SiluAndMul's native kernel and the AMX gate_up GEMM with SiluAndMul fused into it: eager bf16
numerics (bit for bit where the inputs are the same bf16 values), ragged shapes, refused inputs."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels.cpu_linear import cpu_linear, cpu_linear_silu_mul, pack_for_cpu
from minivllm.model_executor.layers.activation import SiluAndMul
from tests.model_executor.layers._helpers import layer_context


def _eager(gate_up: torch.Tensor) -> torch.Tensor:
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


@pytest.mark.requires_native
@pytest.mark.parametrize("m,d", [(1, 16), (3, 5), (64, 1536), (7, 33), (130, 48)])
def test_silu_mul_kernel_equals_eager_bf16(m, d):
    gen = torch.Generator().manual_seed(m * 31 + d)
    x = (torch.randn(m, 2 * d, generator=gen) * 4).bfloat16()
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])          # exp(-|g|) underflows / is 1
    y = ops.silu_and_mul_bf16(x)
    assert y is not None and y.shape == (m, d)
    assert torch.equal(y, _eager(x))


@pytest.mark.requires_native
def test_silu_mul_kernel_strided_rows_and_refusals():
    x_full = torch.randn(9, 80).bfloat16()
    x = x_full[:, :64]                                      # rows 80 elements apart
    assert torch.equal(ops.silu_and_mul_bf16(x), _eager(x))
    assert ops.silu_and_mul_bf16(x.float()) is None         # fp32 stays with torch
    assert ops.silu_and_mul_bf16(torch.randn(4, 7).bfloat16()) is None   # odd width


def test_silu_and_mul_layer_cpu_path_matches_native():
    with layer_context(["all"]):
        op = SiluAndMul()
    x = torch.randn(5, 96).bfloat16()
    assert torch.equal(op(x), op.forward_native(x))
    xf = torch.randn(5, 96)
    assert torch.equal(op(xf), op.forward_native(xf))


def _needs_amx():
    if not ops._has_amx:
        pytest.skip("this CPU (or kernel) offers no AMX: the fused GEMM then stays unused")


@pytest.mark.requires_native
@pytest.mark.parametrize("m", [1, 15, 16, 17, 40, 64, 65, 150])
@pytest.mark.parametrize("d,k", [(16, 32), (1536, 576), (48, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_gemm_equals_gemm_then_activation(m, d, k, with_bias):
    _needs_amx()
    gen = torch.Generator().manual_seed(m * 7919 + d + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(2 * d, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(2 * d, generator=gen).bfloat16() if with_bias else None
    y = ops.gemm_silu_mul_bf16(x, w, b)
    assert y.shape == (m, d) and y.dtype == torch.bfloat16
    # the same gate/up values (one kernel, same accumulation order), then eager's roundings
    assert torch.equal(y, _eager(ops.gemm_bf16(x, w, b)))
    exact = _eager(F.linear(x.float(), w.float(), None if b is None else b.float()))
    torch.testing.assert_close(y.float(), exact, atol=2e-2, rtol=2e-2)


@pytest.mark.requires_native
def test_fused_gemm_refuses_bad_shapes():
    _needs_amx()
    w = torch.randn(64, 64).bfloat16()
    with pytest.raises(ValueError, match="d % 16"):
        ops.gemm_silu_mul_bf16(torch.randn(4, 64).bfloat16(), torch.randn(48, 64).bfloat16(), None)
    with pytest.raises(ValueError, match="M >= 1"):
        ops.gemm_silu_mul_bf16(torch.randn(0, 64).bfloat16(), w, None)


@pytest.mark.parametrize("rows", [1, 64, 65, 300, 1100])
def test_fused_linear_op_routes_and_matches_unfused(rows, monkeypatch):
    # rows the AMX GEMM takes: one fused call; more (long prefill chunks): the linear, then the
    # activation kernel.
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(96, 64) * 0.1).bfloat16(), requires_grad=False)
    pack_for_cpu(layer)
    w = layer.weight
    x = torch.randn(rows, 64).bfloat16()
    calls = []
    real = ops.gemm_silu_mul_bf16
    monkeypatch.setattr(ops, "gemm_silu_mul_bf16", lambda *a: calls.append(1) or real(*a))
    y = cpu_linear_silu_mul(x, w, None)
    assert len(calls) == (1 if rows <= ops.GEMM_PROMPT_ROWS and ops._has_amx else 0)
    assert torch.equal(y, _eager(cpu_linear(x, w, None)))
