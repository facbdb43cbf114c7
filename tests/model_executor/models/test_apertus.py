"""Apertus (per-head QK RMSNorm, non-gated xIELU MLP, Llama 3 RoPE) against transformers."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import ApertusConfig, ApertusForCausalLM

from minivllm.model_executor.models import apertus
from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         write_tiny_checkpoint)

ARCH = "ApertusForCausalLM"


def _randomise_xielu(path: str) -> None:
    """xIELU's alphas start at the constructor's defaults, which an unloaded layer would also
    have: give each layer its own."""
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in state if ".act_fn.alpha_" in n]:
        state[name] = state[name] + 0.5 * torch.randn(state[name].shape, generator=gen)
    save_file(state, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def apertus_path(tmp_path_factory) -> str:
    # The config's default RoPE is Llama 3 scaling; q / k norms are perturbed by the helper.
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("apertus"), ApertusConfig,
                                 ApertusForCausalLM)
    _randomise_xielu(path)
    return path


def test_apertus_matches_transformers(apertus_path):
    assert_matches_transformers(apertus_path)
    assert_prefixes_clean(apertus_path, ARCH)
    layers = build_model(apertus_path).model.layers
    state = load_file(os.path.join(apertus_path, "model.safetensors"))
    for i, layer in enumerate(layers):
        assert not hasattr(layer.mlp, "gate_up_proj")
        assert layer.self_attn.q_norm.weight.shape == (16,)       # one norm per head_dim
        assert torch.equal(layer.mlp.act_fn.alpha_p, state[f"model.layers.{i}.mlp.act_fn.alpha_p"])
        assert torch.equal(layer.mlp.act_fn.alpha_n, state[f"model.layers.{i}.mlp.act_fn.alpha_n"])


def test_apertus_rejects_other_activations():
    with pytest.raises(ValueError, match="xielu"):
        apertus.ApertusMLP(64, 128, "silu", prefix="model.layers.0.mlp")
