"""quant_utils / fp8_utils at vLLM's paths: group shapes, scaled dequantisation, per-token-group
fp8 quantisation, and the dense weight of a linear layer (plain, fp8, or through its kernel)."""

import pytest
import torch

from minivllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.quantization.fp8 import Fp8Config
from minivllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
from minivllm.model_executor.layers.quantization.utils.quant_utils import (
    GroupShape, get_and_maybe_dequant_weights, scaled_dequantize)
from minivllm.model_executor.model_loader.utils import process_weights_after_loading
from tests.model_executor.layers._helpers import layer_context


def test_group_shapes_and_block_dequantise():
    assert GroupShape.PER_TOKEN.is_per_token() and GroupShape(1, 128).is_per_group()
    q = torch.arange(24, dtype=torch.float32).view(4, 6)
    scales = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])     # [4/2, 6/2] blocks
    out = scaled_dequantize(q, scales, GroupShape(2, 2), torch.float32)
    assert out[0, 0] == 0 and out[1, 5] == 11 * 3 and out[3, 2] == 20 * 20
    assert torch.equal(scaled_dequantize(q, torch.tensor(0.5)), q * 0.5)


def test_per_token_group_quant_fp8_round_trips():
    x = torch.randn(3, 5, 64)
    q, scale = per_token_group_quant_fp8(x, 16)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (3, 5, 4)
    back = q.float().view(3, 5, 4, 16) * scale[..., None]
    assert (back.view_as(x) - x).abs().max() <= x.abs().max() * 0.07     # one e4m3 step
    with pytest.raises(ValueError, match="multiple of group_size"):
        per_token_group_quant_fp8(torch.randn(2, 10), 16)


def test_dense_weight_of_plain_fp8_and_all_reduced_layers():
    with layer_context() as config:
        plain = ColumnParallelLinear(32, 48, bias=False, prefix="plain")
        assert get_and_maybe_dequant_weights(plain, torch.float32) is plain.weight
        fp8 = ColumnParallelLinear(32, 48, bias=False, quant_config=Fp8Config.from_config({}),
                                   prefix="fp8")
        fp8.weight.data.copy_(torch.randn(48, 32))
        holder = torch.nn.Sequential(fp8)
        process_weights_after_loading(holder, config.model_config)       # online fp8 now
        assert fp8.weight.dtype == torch.float8_e4m3fn
        dense = get_and_maybe_dequant_weights(fp8, torch.float32)
        assert torch.equal(dense, fp8.quant_method.dequantize_weight(fp8))
        biased = RowParallelLinear(32, 8, bias=True, prefix="biased")
        with pytest.raises(ValueError, match="bias-free"):
            get_and_maybe_dequant_weights(biased, torch.float32)
