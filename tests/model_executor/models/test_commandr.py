"""Cohere Command-R (parallel blocks, GPT-J RoPE, logit scale; R+'s per-head QK norm) and
Cohere2 (interleaved sliding / position-free global layers) against transformers."""

import pytest
from transformers import Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         make_prompts, write_tiny_checkpoint)

BASE = dict(rms_norm_eps=None, layer_norm_eps=1e-5, logit_scale=0.5, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qk_norm_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("command_r_plus"), CohereConfig,
                                 CohereForCausalLM, use_qk_norm=True, **BASE)


def test_cohere_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "command_r", CohereConfig, CohereForCausalLM, **BASE)
    assert_matches_transformers(path)
    assert_prefixes_clean(path, "CohereForCausalLM")
    assert build_model(path).logits_processor.scale == 0.5


def test_cohere_qk_norm_matches_transformers(qk_norm_path, tmp_path):
    assert_matches_transformers(qk_norm_path)
    assert_bad_names_reported(qk_norm_path, tmp_path / "broken",
                              drop=["model.layers.1.self_attn.q_norm.weight", "model.norm.weight"])


@pytest.mark.slow
def test_cohere_qk_norm_tp2(qk_norm_path):
    """Each rank keeps the rows of its own heads of the `[heads, head_dim]` norm weights."""
    assert_matches_transformers(qk_norm_path, prompts=make_prompts(1000, lens=(9, 40)),
                                num_tokens=12, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def cohere2_path(tmp_path_factory) -> str:
    # Layer 0 slides over 8 tokens with RoPE, layer 1 attends globally without positions.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("command_r7b"), Cohere2Config,
                                 Cohere2ForCausalLM, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"], **BASE)


def test_cohere2_sliding_and_global_layers(cohere2_path):
    path = cohere2_path
    assert_matches_transformers(path)
    model = build_model(path)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [True, False]
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, None]


@pytest.mark.slow
def test_cohere2_pp2(cohere2_path):
    """Two pipeline stages: the un-added branch sum and the residual cross as intermediate
    tensors, the tied LM head sits on the last stage."""
    assert_matches_transformers(cohere2_path, prompts=make_prompts(1000, lens=(9, 40)),
                                num_tokens=12, pipeline_parallel_size=2)


def test_cohere_is_registered():
    for arch in ("CohereForCausalLM", "Cohere2ForCausalLM"):
        cls, _ = ModelRegistry.resolve_model_cls([arch])
        assert cls.__name__ == "CohereForCausalLM"
