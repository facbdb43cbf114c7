"""Qwen3 (minivllm's qwen3.py) against transformers' Qwen3ForCausalLM: QK-norm, explicit head_dim,
attention_bias; fp32 greedy and logprobs, prefixes, bad checkpoint names, registry."""

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                          assert_matches_transformers,
                                                          assert_prefixes_clean,
                                                          write_checkpoints)

CONFIGS = {
    # head_dim 32 != hidden / heads (16): q/k/v are wider than the hidden state.
    "head_dim32_tied": dict(head_dim=32, tie_word_embeddings=True),
    "bias_kv1": dict(head_dim=16, attention_bias=True, num_key_value_heads=1, vocab_size=777),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return write_checkpoints(tmp_path_factory, "qwen3", Qwen3Config, Qwen3ForCausalLM, CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_qwen3_matches_transformers(paths, name):
    assert_matches_transformers(paths[name], CONFIGS[name].get("vocab_size", 1000))


def test_qwen3_prefixes_clean(paths):
    assert_prefixes_clean(paths["bias_kv1"], "Qwen3ForCausalLM")


def test_qwen3_reports_every_bad_name(paths, tmp_path):
    assert_bad_names_reported(paths["head_dim32_tied"], tmp_path / "broken",
                              drop=["model.layers.0.self_attn.k_norm.weight", "model.norm.weight"])


def test_qwen3_registered():
    cls, _ = ModelRegistry.resolve_model_cls(["Qwen3ForCausalLM"])
    assert cls.__name__ == "Qwen3ForCausalLM"
