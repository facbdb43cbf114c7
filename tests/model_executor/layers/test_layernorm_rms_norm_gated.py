"""`RMSNormGated` (vLLM's gated RMS norm of Mamba-2 / Gated DeltaNet outputs) against the
formulas written out: norm before or after the gate, one group or several, silu or sigmoid,
and its refusal of an unknown activation."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.layernorm import RMSNormGated
from tests.model_executor.layers._helpers import layer_context


@pytest.fixture(autouse=True)
def _config():
    with layer_context() as config:
        yield config


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_matches_the_formula(norm_before_gate, group_size, activation):
    torch.manual_seed(0)
    x, z = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    norm = RMSNormGated(8, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate,
                        activation=activation)
    norm.weight.data = 1 + 0.3 * torch.randn(8)
    act = torch.sigmoid if activation == "sigmoid" else F.silu
    size = group_size or 8
    inner = x if norm_before_gate else x * act(z)
    ref = _rms(inner.view(5, 3, -1, size), 1e-5).view(5, 3, 8) * norm.weight
    if norm_before_gate:
        ref = ref * act(z)
    torch.testing.assert_close(norm(x, z), ref)
    torch.testing.assert_close(norm(x), _rms(x.view(5, 3, -1, size), 1e-5).view(5, 3, 8)
                               * norm.weight)


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="silu, swish, sigmoid"):
        RMSNormGated(8, activation="gelu")
