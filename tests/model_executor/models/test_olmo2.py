"""OLMo 2 (post-norm blocks, QK-norm over all heads) against transformers, at TP = 1 and 2."""

import pytest
from transformers import Olmo2Config, Olmo2ForCausalLM

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         make_prompts, write_tiny_checkpoint)


@pytest.fixture(scope="module")
def olmo2_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("olmo2"), Olmo2Config, Olmo2ForCausalLM)


def test_olmo2_matches_transformers(olmo2_path, tmp_path):
    assert_matches_transformers(olmo2_path)
    assert_prefixes_clean(olmo2_path, "Olmo2ForCausalLM")
    assert_bad_names_reported(olmo2_path, tmp_path / "broken",
                              drop=["model.layers.0.self_attn.k_norm.weight",
                                    "model.layers.1.post_feedforward_layernorm.weight"])


@pytest.mark.slow
def test_olmo2_tp2_matches_transformers(olmo2_path):
    """TP = 2 gathers q / k for the norm over every head and splits them again."""
    assert_matches_transformers(olmo2_path, prompts=make_prompts(1000, lens=(9, 40)),
                                num_tokens=12, tensor_parallel_size=2)


def test_olmo2_is_registered():
    cls, _ = ModelRegistry.resolve_model_cls(["Olmo2ForCausalLM"])
    assert cls.__module__ == "minivllm.model_executor.models.olmo2"


def test_olmo3_sliding_layers_and_rope_per_layer_type(tmp_path):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    # transformers nests rope_parameters by layer type; the two types get different thetas.
    path = write_tiny_checkpoint(
        tmp_path / "olmo3", Olmo3Config, Olmo3ForCausalLM, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 500.0}})
    assert_matches_transformers(path)
    model = build_model(path)
    assert [layer.self_attn.rotary_emb.base for layer in model.model.layers] == [10000.0, 500.0]
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, None]
    cls, _ = ModelRegistry.resolve_model_cls(["Olmo3ForCausalLM"])
    assert cls.__name__ == "Olmo2ForCausalLM"
