"""bf16 CPU linears use a oneDNN-packed weight copy after loading; fp32 keeps plain F.linear."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from minivllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.model_executor.layers.linear import QKVParallelLinear


def _layer(dtype: torch.dtype) -> QKVParallelLinear:
    ensure_model_parallel_initialized(1, 1)
    cfg = VllmConfig(model_config=ModelConfig(model="dummy", hf_config=LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)))
    with set_current_vllm_config(cfg):
        layer = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (x86 CPU wheel)")
def test_bf16_packed_matches_plain_linear():
    """A oneDNN-blocked copy where oneDNN computes bf16 here; none on AVX2-only CPUs, where
    oneDNN refuses bf16 (the layer still runs, through fp32 tiles or torch's GEMM)."""
    from minivllm.model_executor.kernels.cpu_linear import onednn_bf16

    layer = _layer(torch.bfloat16)
    assert (layer.weight._mkldnn_packed is not None) == onednn_bf16()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    out, _ = layer(x)
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=2e-2)


def test_fp32_keeps_plain_linear_exactly():
    layer = _layer(torch.float32)
    assert layer.weight._mkldnn_packed is None
    x = torch.randn(5, 64)
    out, _ = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_linear_op_matches_the_layer(dtype):
    """`minivllm::cpu_linear`, the op compiled graphs call with the plain weight, finds the
    packed copy hanging on it: same output as the eager layer, bit for bit."""
    layer = _layer(dtype)
    x = torch.randn(5, 64, dtype=dtype)
    out, _ = layer(x)
    assert torch.equal(torch.ops.minivllm.cpu_linear(x, layer.weight, layer.bias), out)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (x86 CPU wheel)")
def test_long_bf16_chunks_take_fp32_tiles_where_bf16_gemms_are_software(monkeypatch):
    """CPUs without AMX or AVX-512 BF16: chunks of FP32_TILE_MIN_ROWS+ rows multiply fp32 tiles
    (one rounding of the fp32 result), shorter ones oneDNN's bf16 GEMM; elsewhere never."""
    from minivllm import _custom_ops as ops
    from minivllm.model_executor.kernels import cpu_linear as cl

    monkeypatch.setattr(cl, "FP32_TILE_ELEMS", 7 * 64)          # 16-row tiles: several of them
    real, calls = cl.fp32_tiles, []
    monkeypatch.setattr(cl, "fp32_tiles", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    if not cl.onednn_bf16():
        pytest.skip("oneDNN has no bf16 path on this CPU: test_avx2_bf16_takes_fp32_tiles")
    for software in (True, False):
        monkeypatch.setattr(ops, "bf16_gemm_in_software", lambda: software)
        if software:        # such a CPU has no AMX either: its AMX GEMM would take no rows
            monkeypatch.setattr(ops, "gemm_rows", lambda weight: 0)
        layer = _layer(torch.bfloat16)
        x = torch.randn(cl.FP32_TILE_MIN_ROWS + 3, 64, dtype=torch.bfloat16)
        exact = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        calls.clear()
        out = cl.cpu_linear(x, layer.weight, layer.bias)
        cl.cpu_linear(x[:cl.FP32_TILE_MIN_ROWS - 1], layer.weight, layer.bias)
        assert calls == ([x.shape[0]] if software else [])
        # fp32 sums of the exact products, rounded once (bf16 GEMMs: within bf16 error)
        torch.testing.assert_close(out, exact.bfloat16(), rtol=2 ** -8 if software else 2e-2,
                                   atol=1e-5 if software else 0.1)


def test_without_onednn_bf16_fp32_tiles_from_two_rows(monkeypatch):
    """AVX2-only CPUs (oneDNN refuses bf16 there): no packed copy, and from NO_ONEDNN_FP32_ROWS
    rows fp32 tiles (torch's own bf16 GEMM was 2-7x slower); one row stays with `F.linear`."""
    from minivllm.model_executor.kernels import cpu_linear as cl

    monkeypatch.setattr(cl, "onednn_bf16", lambda: False)
    real, calls = cl.fp32_tiles, []
    monkeypatch.setattr(cl, "fp32_tiles", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    layer = _layer(torch.bfloat16)
    assert layer.weight._mkldnn_packed is None and layer.weight._fp32_rows == 2
    layer.weight._gemv_ok, layer.weight._amx_rows = False, 0    # such CPUs have neither
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    out = cl.cpu_linear(x, layer.weight, layer.bias)
    one = cl.cpu_linear(x[:1], layer.weight, layer.bias)
    assert calls == [9]
    exact = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(out, exact.bfloat16(), rtol=2 ** -8, atol=1e-5)
    torch.testing.assert_close(one, F.linear(x[:1], layer.weight, layer.bias))
