"""Mistral (minivllm's mistral.py) against transformers' Mistral and Ministral 3: model-wide
sliding window, Llama-4 q scaling with YaRN; fp32 greedy and logprobs, prefixes, registry."""

import pytest
from transformers import (MistralConfig, MistralForCausalLM, Ministral3Config,
                          Ministral3ForCausalLM)

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                          assert_matches_transformers,
                                                          assert_prefixes_clean,
                                                          write_tiny_checkpoint)

# q scaling steps up every 16 positions; YaRN stretches 16 positions to 512 (max_position).
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 32.0,
                   "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                   "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}


@pytest.fixture(scope="module")
def mistral_path(tmp_path_factory) -> str:
    # A window of 8 tokens, shorter than three of the four prompts.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mistral"), MistralConfig,
                                 MistralForCausalLM, head_dim=16, sliding_window=8)


def test_mistral_matches_transformers(mistral_path):
    assert_matches_transformers(mistral_path)


def test_ministral3_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path, Ministral3Config, Ministral3ForCausalLM, head_dim=16,
                                 rope_parameters=MINISTRAL3_ROPE, sliding_window=None)
    assert_matches_transformers(path)


def test_mistral_prefixes_and_bad_names(mistral_path, tmp_path):
    assert_prefixes_clean(mistral_path, "MistralForCausalLM")
    assert_bad_names_reported(mistral_path, tmp_path / "broken",
                              drop=["model.layers.0.post_attention_layernorm.weight"])


def test_mistral_registered():
    for arch in ("MistralForCausalLM", "Ministral3ForCausalLM"):
        assert ModelRegistry.resolve_model_cls([arch])[0].__name__ == "MistralForCausalLM"
