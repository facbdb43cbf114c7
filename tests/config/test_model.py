"""ModelConfig's quantization and dtype resolution: the checkpoint's method unless told otherwise."""

import pytest
import torch
from transformers import LlamaConfig

from minivllm.config.model import checkpoint_quant_method, resolve_dtype, resolve_quantization


def _config(quant: dict | None = None, dtype: str | None = None) -> LlamaConfig:
    config = LlamaConfig()
    if quant is not None:
        config.quantization_config = quant
    if dtype is not None:
        config.dtype = dtype
    return config


def test_the_checkpoint_method_is_the_default():
    assert checkpoint_quant_method(_config()) is None
    assert checkpoint_quant_method(_config({"quant_method": "Compressed_Tensors"})) == \
        "compressed-tensors"
    assert resolve_quantization(None, _config({"quant_method": "fp8"}), False) == "fp8"
    assert resolve_quantization(None, _config(), True) == "gguf"
    assert resolve_quantization(None, _config(), False) is None
    assert resolve_quantization("INT4", _config(), False) == "int4"       # online


def test_none_and_conflicts():
    assert resolve_quantization("none", _config(), True) is None          # dequantised GGUF
    with pytest.raises(ValueError, match="quantized with 'fp8'.*only dequantises GGUF"):
        resolve_quantization("none", _config({"quant_method": "fp8"}), False)
    with pytest.raises(ValueError, match="quantized with 'awq', but quantization='gptq'"):
        resolve_quantization("gptq", _config({"quant_method": "awq"}), False)


def test_auto_dtype_for_quantized_runs():
    fp32_ckpt = _config(dtype="float32")
    assert resolve_dtype("auto", fp32_ckpt) == torch.float32
    assert resolve_dtype("auto", fp32_ckpt, half_only=True) == torch.bfloat16    # fp8
    assert resolve_dtype("auto", _config(dtype="float16"), half_only=True) == torch.float16
    # packed GGUF: bf16 where oneDNN computes it or the int8 kernels have an AVX2 path
    from minivllm import _custom_ops as ops
    bf16_native = torch.ops.mkldnn._is_mkldnn_bf16_supported() or (
        ops.cpu_has("avx2") and ops.native_available())
    assert resolve_dtype("auto", fp32_ckpt, packed_gguf=True) == (
        torch.bfloat16 if bf16_native else torch.float32)
    assert resolve_dtype("float32", fp32_ckpt, packed_gguf=True) == torch.float32
