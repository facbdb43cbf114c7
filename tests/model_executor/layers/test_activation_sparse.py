"""`GeluAndMulSparse` (Gemma 3n's gaussian top-k gate) and the registries' module lookup that
vLLM's model files use (`_ACTIVATION_REGISTRY[name]`)."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.activation import (_ACTIVATION_AND_MUL_REGISTRY,
                                                       _ACTIVATION_REGISTRY, GeluAndMul,
                                                       GeluAndMulSparse)
from tests.model_executor.layers._helpers import layer_context


@pytest.fixture(autouse=True)
def _layer_context():
    with layer_context():     # CustomOps read the current config when built
        yield


@pytest.mark.parametrize("sparsity", [0.95, 0.5, 0.2])
def test_sparse_gate_matches_transformers_gaussian_topk(sparsity):
    from transformers import Gemma3nTextConfig
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    config = Gemma3nTextConfig(hidden_size=8, intermediate_size=64, num_hidden_layers=1,
                               activation_sparsity_pattern=[sparsity], num_kv_shared_layers=0,
                               layer_types=["full_attention"])
    reference = Gemma3nTextMLP(config)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))  # [T, 2 * I]
    gate, up = x.chunk(2, dim=-1)
    expected = F.gelu(reference._gaussian_topk(gate), approximate="tanh") * up
    torch.testing.assert_close(GeluAndMulSparse(sparsity, approximate="tanh")(x), expected)


def test_sparse_gate_zeroes_about_the_asked_fraction():
    gate = torch.randn(4, 20000, generator=torch.Generator().manual_seed(1))
    out = GeluAndMulSparse(0.9)(torch.cat([gate, torch.ones_like(gate)], dim=-1))
    zeroed = (out == 0).float().mean().item()
    assert abs(zeroed - 0.9) < 0.01
    dense = GeluAndMul()(torch.cat([gate, torch.ones_like(gate)], dim=-1))
    assert (dense == 0).float().mean().item() < 0.01


@pytest.mark.parametrize("sparsity", [0.0, 1.0, -0.1])
def test_sparse_gate_refuses_sparsity_outside_0_1(sparsity):
    with pytest.raises(ValueError, match="activation_sparsity"):
        GeluAndMulSparse(sparsity)


def test_registries_index_to_new_modules():
    act = _ACTIVATION_REGISTRY["gelu_pytorch_tanh"]
    assert isinstance(act, torch.nn.GELU) and act.approximate == "tanh"
    assert _ACTIVATION_REGISTRY["silu"] is not _ACTIVATION_REGISTRY["silu"]
    gated = _ACTIVATION_AND_MUL_REGISTRY["gelu_pytorch_tanh"]
    assert isinstance(gated, GeluAndMul) and gated.approximate == "tanh"
    assert "xielu" in _ACTIVATION_REGISTRY and "relu" not in _ACTIVATION_AND_MUL_REGISTRY
    assert "silu" in _ACTIVATION_AND_MUL_REGISTRY and "gelu_42" not in _ACTIVATION_REGISTRY
    with pytest.raises(KeyError):
        _ACTIVATION_REGISTRY["gelu_42"]
