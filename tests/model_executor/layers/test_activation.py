"""Activations (gated and plain, get_act_fn / get_act_and_mul_fn against transformers) and the fused-act-quant hook without a quant key."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.activation import (_ACTIVATION_REGISTRY, XIELU, FatreluAndMul,
                                                       GeluAndMul, MulAndSilu, QuickGELU,
                                                       ReLUSquaredActivation, SiluAndMul,
                                                       SiluAndMulWithClamp, get_act_and_mul_fn,
                                                       get_act_fn)
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


# HF name -> transformers' own implementation (ACT2FN), the reference for get_act_fn.
HF_NAMES = ["gelu", "gelu_fast", "gelu_new", "gelu_pytorch_tanh", "relu", "relu2", "silu",
            "swish", "quick_gelu", "tanh", "sigmoid"]


@pytest.mark.parametrize("name", HF_NAMES)
def test_get_act_fn_matches_transformers(name):
    from transformers.activations import ACT2FN

    x = torch.randn(5, 16, dtype=torch.float64) * 3
    with layer_context():
        act = get_act_fn(name.upper() if name == "relu" else name)   # case-insensitive
    torch.testing.assert_close(act(x), ACT2FN[name](x), rtol=1e-12, atol=1e-12)


def test_xielu_matches_transformers_and_loads_its_parameters():
    from transformers.activations import XIELUActivation

    torch.manual_seed(0)
    ref = XIELUActivation(alpha_p_init=0.6, alpha_n_init=0.9, beta=0.4, dtype=torch.float32)
    with layer_context():
        ours = get_act_fn("xielu")
    assert ours.alpha_p.shape == ours.alpha_n.shape == (1,)
    ours.alpha_p.data.copy_(ref.alpha_p.data)       # checkpoint names are the same
    ours.alpha_n.data.copy_(ref.alpha_n.data)
    ours.beta.copy_(ref.beta)
    x = torch.linspace(-6, 6, 101)
    torch.testing.assert_close(ours(x), ref._xielu_python(x))
    with layer_context():
        default = XIELU(dtype=torch.float32)
    # softplus of the stored values gives back the init values (0.8 and 0.8 - beta).
    torch.testing.assert_close(F.softplus(default.alpha_p), torch.tensor([0.8]))
    torch.testing.assert_close(F.softplus(default.alpha_n), torch.tensor([0.3]))


def test_gated_activations():
    x = torch.randn(4, 2, 12) * 4
    a, b = x[..., :6], x[..., 6:]
    with layer_context():
        gelu, gelu_tanh = get_act_and_mul_fn("gelu"), get_act_and_mul_fn("gelu_pytorch_tanh")
        silu, geglu = get_act_and_mul_fn("SiLU"), get_act_and_mul_fn("geglu")
        clamp, fatrelu = SiluAndMulWithClamp(2.5), FatreluAndMul(threshold=0.5)
        mul_silu = MulAndSilu()
    assert isinstance(silu, SiluAndMul) and isinstance(geglu, GeluAndMul)
    torch.testing.assert_close(gelu(x), F.gelu(a) * b)
    torch.testing.assert_close(gelu_tanh(x), F.gelu(a, approximate="tanh") * b)
    torch.testing.assert_close(silu(x), F.silu(a) * b)
    torch.testing.assert_close(clamp(x), F.silu(a.clamp(max=2.5)) * b.clamp(-2.5, 2.5))
    assert clamp(x).abs().max() > 0 and (clamp(x) != silu(x)).any()   # the clamp bites here
    torch.testing.assert_close(fatrelu(x), torch.where(a > 0.5, a, 0.0) * b)
    torch.testing.assert_close(mul_silu(x), a * F.silu(b))
    with layer_context():
        quick = QuickGELU()
    torch.testing.assert_close(quick(a), a * torch.sigmoid(1.702 * a))


def test_unknown_activation_names_value_and_choices():
    with pytest.raises(ValueError) as err:
        get_act_fn("gelu_42")
    assert "'gelu_42'" in str(err.value) and "quick_gelu" in str(err.value)
    with pytest.raises(ValueError) as err:
        get_act_and_mul_fn("relu")
    assert "'relu'" in str(err.value) and "silu" in str(err.value)
    assert isinstance(get_act_fn("torch.nn.modules.linear.Identity"), torch.nn.Identity)
    assert set(HF_NAMES) | {"xielu"} == set(_ACTIVATION_REGISTRY)
