"""OLMoE (QK-norm over all heads, clip_qkv, sparse every layer) against transformers."""

import pytest
from transformers import OlmoeConfig, OlmoeForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean,
                                                         write_tiny_checkpoint)

TINY_MOE = dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def olmoe_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("olmoe"), OlmoeConfig,
                                 OlmoeForCausalLM, **TINY_MOE)


def test_olmoe_matches_transformers(olmoe_path):
    assert_matches_transformers(olmoe_path)


def test_olmoe_clip_qkv_and_renormalised_topk(tmp_path):
    # initializer_range 0.5 makes q/k/v large enough that a clip of 0.5 bites.
    path = write_tiny_checkpoint(tmp_path, OlmoeConfig, OlmoeForCausalLM, seed=1, clip_qkv=0.5,
                                 norm_topk_prob=True, initializer_range=0.5, **TINY_MOE)
    assert_matches_transformers(path)


def test_olmoe_prefixes_and_bad_names(olmoe_path, tmp_path):
    assert_prefixes_clean(olmoe_path, "OlmoeForCausalLM")
    assert_bad_names_reported(olmoe_path, tmp_path / "broken",
                              drop=["model.layers.0.self_attn.k_norm.weight"])
