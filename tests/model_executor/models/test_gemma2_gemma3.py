"""Gemma 2 and Gemma 3 (text) against transformers: sandwich norms, attention and final-logit
soft-capping, query_pre_attn_scalar, interleaved sliding / global layers (window 8 < prompts),
QK-norm and per-layer-type RoPE; prefixes, bad names, registry."""

import pytest
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                          assert_matches_transformers,
                                                          assert_prefixes_clean,
                                                          write_tiny_checkpoint)

# Small caps so that they bite on random weights; a window shorter than three of the prompts.
GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
              final_logit_softcapping=3.0, sliding_window=8, rms_norm_eps=1e-6)
GEMMA3 = dict(head_dim=32, query_pre_attn_scalar=16, sliding_window=8, rms_norm_eps=1e-6,
              layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 10000.0}})


@pytest.fixture(scope="module")
def gemma2_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gemma2"), Gemma2Config,
                                 Gemma2ForCausalLM, **GEMMA2)


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), Gemma3TextConfig,
                                 Gemma3ForCausalLM, **GEMMA3)


def test_gemma2_matches_transformers(gemma2_path):
    assert_matches_transformers(gemma2_path)


def test_gemma3_matches_transformers(gemma3_path):
    assert_matches_transformers(gemma3_path)


def test_gemma3_soft_caps(tmp_path):
    """Only the final-logit cap applies: transformers' Gemma 3 ignores attn_logit_softcapping."""
    path = write_tiny_checkpoint(tmp_path, Gemma3TextConfig, Gemma3ForCausalLM,
                                 **{**GEMMA3, "attn_logit_softcapping": 2.0,
                                    "final_logit_softcapping": 3.0})
    assert_matches_transformers(path, prompts=[list(range(3, 40))], num_tokens=8)


def test_gemma2_window_and_caps_are_per_layer(gemma2_path):
    from tests.model_executor.models._family_helpers import build_model

    model = build_model(gemma2_path)
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [8, None]
    assert all(a.impl.logits_soft_cap == 2.0 and a.scale == 24**-0.5 for a in attns)
    assert model.logits_processor.soft_cap == 3.0


def test_prefixes_and_bad_names(gemma2_path, gemma3_path, tmp_path):
    assert_prefixes_clean(gemma2_path, "Gemma2ForCausalLM")
    assert_prefixes_clean(gemma3_path, "Gemma3ForCausalLM")
    assert_bad_names_reported(gemma3_path, tmp_path / "broken",
                              drop=["model.layers.0.self_attn.q_norm.weight",
                                    "model.layers.1.pre_feedforward_layernorm.weight"])


def test_gemma2_gemma3_registered():
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert ModelRegistry.resolve_model_cls([arch])[0].__name__ == arch
    # vLLM's embedding name for Gemma 2 checkpoints: the causal class, pooled when asked.
    assert ModelRegistry.resolve_model_cls(["Gemma2Model"])[0].__name__ == "Gemma2ForCausalLM"
