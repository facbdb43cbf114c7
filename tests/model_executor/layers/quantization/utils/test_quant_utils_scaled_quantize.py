"""`scaled_quantize` (vLLM's name, MiMo-V2's fp8 weight requantisation): per-block fp8 scales,
each block's largest magnitude at fp8's largest value; `scaled_dequantize` inverts it."""

import pytest
import torch

from minivllm.model_executor.layers.quantization.utils.quant_utils import (GroupShape,
                                                                           scaled_dequantize,
                                                                           scaled_quantize)


@pytest.mark.parametrize("group", [GroupShape(4, 8), GroupShape(-1, -1), GroupShape(1, -1)])
def test_block_scales_round_trip(group):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 3
    x_q, scale = scaled_quantize(x, group, torch.float8_e4m3fn, compute_dtype=torch.float32)
    rows = group.row if group.row > 0 else 8
    cols = group.col if group.col > 0 else 16
    assert x_q.dtype == torch.float8_e4m3fn and scale.shape == (8 // rows, 16 // cols)
    # The largest magnitude of each block lands on fp8's largest value.
    blocks = x_q.float().reshape(8 // rows, rows, 16 // cols, cols).abs().amax(dim=(1, 3))
    torch.testing.assert_close(blocks, torch.full_like(blocks, 448.0))
    back = scaled_dequantize(x_q, scale, group)
    torch.testing.assert_close(back, x, rtol=0.07, atol=1e-6)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="floating-point quant_dtype"):
        scaled_quantize(torch.ones(4, 4), GroupShape(2, 2), torch.int8)
    with pytest.raises(ValueError, match="divides"):
        scaled_quantize(torch.ones(4, 6), GroupShape(4, 4), torch.float8_e4m3fn)
