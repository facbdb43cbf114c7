"""Activations (SiluAndMul, GeluAndMul, ReLU^2) and the fused-act-quant hook without a quant key."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.activation import (GeluAndMul, ReLUSquaredActivation,
                                                       SiluAndMul)
from minivllm.model_executor.layers.fusion.fused_act_quant import maybe_fused_act_quant
from minivllm.model_executor.layers.linear import RowParallelLinear
from tests.model_executor.layers._helpers import layer_context


def test_activations():
    with layer_context():
        silu, gelu, relu2 = SiluAndMul(), GeluAndMul("tanh"), ReLUSquaredActivation()
        down = RowParallelLinear(4, 4, bias=False)
    x = torch.randn(3, 2, 8)
    torch.testing.assert_close(silu(x), F.silu(x[..., :4]) * x[..., 4:])
    torch.testing.assert_close(gelu(x), F.gelu(x[..., :4], approximate="tanh") * x[..., 4:])
    torch.testing.assert_close(relu2(x), F.relu(x) ** 2)
    torch.testing.assert_close(maybe_fused_act_quant(silu, x, down), silu(x))
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        with layer_context():
            GeluAndMul("fast")
