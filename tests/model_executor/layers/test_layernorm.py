"""RMSNorm numerics (vs a reference and transformers), its variants and weight attributes."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.model_loader.weight_utils import default_weight_loader
from tests.model_executor.layers._helpers import layer_context


def reference_rms_norm(x, weight, eps, residual=None):
    x32 = x.float() + (residual.float() if residual is not None else 0)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed.to(weight.dtype) * weight).to(x.dtype)
    return out if residual is None else (out, x32.to(x.dtype))


@pytest.mark.parametrize("custom_ops", [["all"], ["none"]])
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_rms_norm_numerics(custom_ops, dtype, weight_dtype):
    with layer_context(custom_ops):
        norm = RMSNorm(32, eps=1e-5, dtype=weight_dtype)
    norm.weight.data.normal_()
    x, residual = torch.randn(7, 32, dtype=dtype), torch.randn(7, 32, dtype=dtype)
    # The fused CPU path (input and weight of one dtype) may differ from the native maths by
    # rounding: 1e-6 in fp32, one rounding step (2 ulp) in bf16. The native path is exact.
    tol = dict(atol=0, rtol=0)
    if dtype == weight_dtype == torch.float32:
        tol = dict(atol=1e-6, rtol=1e-6)
    elif dtype == weight_dtype and custom_ops == ["all"]:
        tol = dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(norm(x), reference_rms_norm(x, norm.weight, 1e-5), **tol)
    out, new_residual = norm(x, residual)
    ref_out, ref_residual = reference_rms_norm(x, norm.weight, 1e-5, residual)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)


def test_rms_norm_cpu_path_matches_native_in_fp32():
    with layer_context(["all"]):
        norm = RMSNorm(64)
    assert norm._forward_method == norm.forward_cpu
    norm.weight.data.normal_()
    x, residual = torch.randn(9, 4, 64) * 3, torch.randn(9, 4, 64)
    torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x), atol=1e-6, rtol=1e-6)
    for fast, native in zip(norm.forward_cpu(x, residual), norm.forward_native(x, residual)):
        torch.testing.assert_close(fast, native, atol=1e-6, rtol=1e-6)


def test_rms_norm_matches_transformers_and_works_per_head():
    with layer_context():
        norm = RMSNorm(16, eps=1e-6)
    hf = LlamaRMSNorm(16, eps=1e-6)
    norm.weight.data.normal_()
    hf.weight.data.copy_(norm.weight.data)
    x = torch.randn(5, 3, 16)  # [T, heads, head_dim], like Qwen3's q/k norm
    torch.testing.assert_close(norm(x), hf(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(norm(x.view(5, 48).view(5, 3, 16)), norm(x))


def test_rms_norm_variants_and_weight_attrs():
    with layer_context():
        norm = RMSNorm(8)
        weightless = RMSNorm(8, has_weight=False)
        partial = RMSNorm(8, var_hidden_size=4)
    # No loader of its own, as in vLLM: a model file may set one (loaders fall back to the default).
    assert not hasattr(norm.weight, "weight_loader")
    assert norm.weight.dummy_weight_value == 1.0 and weightless.weight is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(weightless(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    expected = x * torch.rsqrt(x[:, :4].pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(partial(x), expected)


def test_layer_norm_matches_torch_and_cohere_forms():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from minivllm.model_executor.layers.layernorm import LayerNorm

    norm, no_bias = LayerNorm(16, eps=1e-5), LayerNorm(16, eps=1e-5, has_bias=False)
    ref = torch.nn.LayerNorm(16, eps=1e-5)
    cohere = CohereLayerNorm(16, eps=1e-5)
    for p in (norm.weight, norm.bias, ref.weight, ref.bias):
        p.data.normal_()
    norm.weight.data.copy_(ref.weight.data)
    norm.bias.data.copy_(ref.bias.data)
    no_bias.weight.data.copy_(ref.weight.data)
    cohere.weight.data.copy_(ref.weight.data)
    assert norm.weight.dtype == torch.float32 and no_bias.bias is None
    assert norm.weight.weight_loader is default_weight_loader
    x, residual = torch.randn(6, 16) * 2 + 1, torch.randn(6, 16)
    torch.testing.assert_close(norm(x), ref(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(no_bias(x), cohere(x), atol=1e-6, rtol=1e-6)
    out, summed = norm(x, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(out, ref(x + residual), atol=1e-6, rtol=1e-6)
    # bf16 input: computed in fp32, returned in the input's dtype
    assert norm(x.bfloat16()).dtype == torch.bfloat16
