"""Mixtral (every layer sparse, w1/w2/w3 expert names, block_sparse_moe) against transformers."""

import pytest
from transformers import MixtralConfig, MixtralForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_cpu_graphs_replay_eager_steps,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean,
                                                         write_tiny_checkpoint)

TINY_MOE = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def mixtral_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), MixtralConfig,
                                 MixtralForCausalLM, **TINY_MOE)


def test_mixtral_matches_transformers(mixtral_path):
    assert_matches_transformers(mixtral_path)


def test_mixtral_sliding_window_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path, MixtralConfig, MixtralForCausalLM, seed=1,
                                 sliding_window=16, **TINY_MOE)
    assert_matches_transformers(path)


def test_mixtral_prefixes_and_bad_names(mixtral_path, tmp_path):
    assert_prefixes_clean(mixtral_path, "MixtralForCausalLM")
    assert_bad_names_reported(
        mixtral_path, tmp_path / "broken",
        drop=["model.layers.1.block_sparse_moe.experts.2.w3.weight",
              "model.layers.0.block_sparse_moe.gate.weight"],
        missing=["model.layers.1.mlp.experts.w13_weight", "model.layers.0.mlp.gate.weight"])



@pytest.mark.requires_native
def test_bf16_decode_steps_replay_from_cpu_graphs(tmp_path):
    """bf16 on AMX: routing and experts are two native calls, so whole MoE decode steps (of 1
    and of 2 sequences) are recorded once and replayed, bit for bit as the eager steps."""
    # 16 experts: the router's [16, 64] weight takes the native GEMM (N % 16 == 0).
    path = write_tiny_checkpoint(tmp_path, MixtralConfig, MixtralForCausalLM, seed=2,
                                 intermediate_size=32, num_local_experts=16,
                                 num_experts_per_tok=2, head_dim=32)
    assert sorted(assert_cpu_graphs_replay_eager_steps(path, (6, 9)).entries) == [1, 2]
