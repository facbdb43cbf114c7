"""`linear/base.py`'s pieces: ALiBi's head slopes (powers of two and not), the layer index
from a prefix, and the state's shape / dtype / copy function from `mamba_utils`."""

import pytest
import torch

from minivllm.model_executor.layers.mamba.linear.base import build_slope_tensor, layer_index
from minivllm.model_executor.layers.mamba.mamba_utils import (MambaStateCopyFuncCalculator,
                                                              MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator,
                                                              get_temporal_copy_spec)


@pytest.mark.parametrize("n", [1, 4, 8, 32])
def test_slopes_for_a_power_of_two_are_alibis_series(n):
    expected = torch.tensor([2 ** (-8 * (i + 1) / n) for i in range(n)])
    slopes = build_slope_tensor(n)
    assert slopes.shape == (n, 1, 1) and torch.allclose(slopes.flatten(), expected)


def test_slopes_for_other_counts_interleave_the_next_power():
    # 6 heads: the 4-head series, then every other slope of the 8-head one (the first two).
    four, eight = build_slope_tensor(4).flatten(), build_slope_tensor(8).flatten()
    assert torch.allclose(build_slope_tensor(6).flatten(), torch.cat([four, eight[0::2][:2]]))


def test_layer_index_needs_one_number():
    assert layer_index("model.layers.3.self_attn") == 3
    with pytest.raises(ValueError, match="exactly one layer number"):
        layer_index("model.self_attn")


def test_state_shape_dtype_and_copy_func():
    assert MambaStateShapeCalculator.linear_attention_state_shape(8, 2, 64) == ((4, 64, 64),)
    assert MambaStateDtypeCalculator.linear_attention_state_dtype(
        torch.bfloat16, "auto") == (torch.bfloat16,)
    assert MambaStateDtypeCalculator.linear_attention_state_dtype(
        torch.bfloat16, "float32") == (torch.float32,)
    assert MambaStateCopyFuncCalculator.linear_attention_state_copy_func() == (
        get_temporal_copy_spec,)


def test_weight_direct_load_uses_the_loader_or_checks_the_shape():
    from minivllm.model_executor.layers.mamba.linear.base import LinearAttention

    param = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
    LinearAttention.weight_direct_load(param, torch.ones(2, 3))
    assert torch.all(param == 1)
    with pytest.raises(ValueError, match="does not fit"):
        LinearAttention.weight_direct_load(param, torch.ones(3, 2))
    param.weight_loader = lambda p, w: p.data.copy_(w[:2])         # a TP shard's loader
    LinearAttention.weight_direct_load(param, torch.full((4, 3), 5.0))
    assert torch.all(param == 5)
