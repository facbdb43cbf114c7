"""Gemma (minivllm's gemma.py) against transformers' GemmaForCausalLM: (1 + w) norms, GELU MLP,
scaled embeddings, tied head, head_dim != hidden / heads; GemmaRMSNorm on its own."""

import pytest
import torch
from transformers import GemmaConfig, GemmaForCausalLM

from minivllm.model_executor.layers.layernorm import GemmaRMSNorm
from minivllm.model_executor.models.gemma import gemma_activation
from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.layers._helpers import layer_context
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                          assert_matches_transformers,
                                                          assert_prefixes_clean,
                                                          write_tiny_checkpoint)

GEMMA = dict(head_dim=32, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh")


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gemma"), GemmaConfig, GemmaForCausalLM,
                                 **GEMMA)


def test_gemma_matches_transformers(gemma_path):
    assert_matches_transformers(gemma_path)


def test_gemma_exact_gelu_untied_bias(tmp_path):
    path = write_tiny_checkpoint(tmp_path, GemmaConfig, GemmaForCausalLM, head_dim=16,
                                 hidden_act="gelu", attention_bias=True, num_key_value_heads=1)
    assert_matches_transformers(path, prompts=[[5, 6, 7, 8, 9, 10, 11]], num_tokens=8)


def test_gemma_prefixes_and_bad_names(gemma_path, tmp_path):
    assert_prefixes_clean(gemma_path, "GemmaForCausalLM")
    assert_bad_names_reported(gemma_path, tmp_path / "broken",
                              drop=["model.layers.1.input_layernorm.weight"])


def test_gemma_rms_norm_matches_transformers():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    torch.manual_seed(0)
    with layer_context(["all"]):
        ours = GemmaRMSNorm(64, eps=1e-6)
    ref = HFGemmaRMSNorm(64, eps=1e-6)
    weight = torch.randn(64)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    x, residual = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-6)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, ref(x + residual), rtol=0, atol=1e-6)


def test_gemma_unknown_activation_names_the_field():
    with pytest.raises(ValueError, match=r"hidden_activation='relu'.*gelu_pytorch_tanh"):
        gemma_activation(GemmaConfig(hidden_activation="relu"))


def test_gemma_registered():
    assert ModelRegistry.resolve_model_cls(["GemmaForCausalLM"])[0].__name__ == "GemmaForCausalLM"
