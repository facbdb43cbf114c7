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
    layer = _layer(torch.bfloat16)
    assert layer.weight._mkldnn_packed is not None
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
