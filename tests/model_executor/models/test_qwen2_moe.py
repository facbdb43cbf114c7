"""Qwen2-MoE (routed experts + a sigmoid-gated shared expert, dense layers by
`mlp_only_layers`) against transformers."""

import pytest
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean,
                                                         write_tiny_checkpoint)

TINY_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                num_experts_per_tok=2)


@pytest.fixture(scope="module")
def qwen2_moe_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), Qwen2MoeConfig,
                                 Qwen2MoeForCausalLM, **TINY_MOE)


def test_qwen2_moe_matches_transformers(qwen2_moe_path):
    assert_matches_transformers(qwen2_moe_path)


def test_qwen2_moe_dense_layer_and_renormalised_topk(tmp_path):
    # Layer 1 is a plain MLP (mlp_only_layers); norm_topk_prob renormalises the top-k weights.
    path = write_tiny_checkpoint(tmp_path, Qwen2MoeConfig, Qwen2MoeForCausalLM, seed=1,
                                 mlp_only_layers=[1], norm_topk_prob=True, **TINY_MOE)
    assert_matches_transformers(path)


def test_qwen2_moe_prefixes_and_bad_names(qwen2_moe_path, tmp_path):
    assert_prefixes_clean(qwen2_moe_path, "Qwen2MoeForCausalLM")
    assert_bad_names_reported(
        qwen2_moe_path, tmp_path / "broken",
        drop=["model.layers.0.mlp.experts.5.down_proj.weight",
              "model.layers.1.mlp.shared_expert_gate.weight"],
        missing=["model.layers.0.mlp.experts.w2_weight",
                 "model.layers.1.mlp.shared_expert_gate.weight"])


def test_qwen2_moe_expert_mapping(qwen2_moe_path):
    from tests.model_executor.models._family_helpers import build_model

    mapping = build_model(qwen2_moe_path).get_expert_mapping()
    assert len(mapping) == 3 * TINY_MOE["num_experts"]
    assert ("experts.w13_", "experts.7.w3.", 7, "w3") in mapping
