"""`SwigluStepAndMul` (Ling 3.0's clipped SwiGLU): the limit applies after the activation,
unlike `SiluAndMulWithClamp`, which clamps the gate before it."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.activation import SiluAndMulWithClamp, SwigluStepAndMul
from tests.model_executor.layers._helpers import layer_context


def test_swiglustep_clips_after_the_activation():
    x = torch.tensor([[10.0, -3.0, 9.0, 0.5], [0.5, 2.0, -9.0, 1.0]])   # [gate | up]
    with layer_context():
        step, before = SwigluStepAndMul(limit=4.0), SiluAndMulWithClamp(4.0)
        with pytest.raises(ValueError, match="limit"):
            SwigluStepAndMul(limit=None)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate).clamp(max=4.0) * up.clamp(-4.0, 4.0)
    torch.testing.assert_close(step(x), expected)
    # silu(10) ~ 10 is clipped to 4 here; clamping first gives silu(4) ~ 3.93 instead
    assert step(x)[0, 0] == pytest.approx(4.0 * 4.0)
    assert not torch.allclose(step(x), before(x))
