"""Qwen3-MoE (QK-norm attention, routed experts only) against transformers, at TP=1."""

import pytest
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from minivllm import LLM
from tests._parallel_helpers import engine_kwargs, greedy_run, prompts
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_cpu_graphs_replay_eager_steps,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean,
                                                         write_tiny_checkpoint)

TINY_MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=32,
                norm_topk_prob=True)


@pytest.fixture(scope="module")
def qwen3_moe_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), Qwen3MoeConfig,
                                 Qwen3MoeForCausalLM, **TINY_MOE)


def test_qwen3_moe_matches_transformers(qwen3_moe_path):
    assert_matches_transformers(qwen3_moe_path)


def test_qwen3_moe_sparse_step_without_renormalising(tmp_path):
    # decoder_sparse_step=2: layer 0 is dense, layer 1 sparse; plain softmax weights.
    overrides = {**TINY_MOE, "norm_topk_prob": False, "decoder_sparse_step": 2}
    path = write_tiny_checkpoint(tmp_path, Qwen3MoeConfig, Qwen3MoeForCausalLM, seed=1,
                                 **overrides)
    assert_matches_transformers(path)


def test_qwen3_moe_prefixes_and_bad_names(qwen3_moe_path, tmp_path):
    assert_prefixes_clean(qwen3_moe_path, "Qwen3MoeForCausalLM")
    assert_bad_names_reported(
        qwen3_moe_path, tmp_path / "broken",
        drop=["model.layers.1.mlp.experts.0.gate_proj.weight"],
        missing=["model.layers.1.mlp.experts.w13_weight"])


@pytest.fixture(scope="module")
def qwen3_moe_reference(qwen3_moe_path):
    llm = LLM(model=qwen3_moe_path, **engine_kwargs())
    return greedy_run(llm, prompts())


# ~15 s each on 2 cores: TP=2 and PP=2 run with the slow tests, EP (MoE-only code) always.
@pytest.mark.parametrize("parallel", [
    pytest.param(dict(tensor_parallel_size=2), id="tp2", marks=pytest.mark.slow),
    pytest.param(dict(pipeline_parallel_size=2), id="pp2", marks=pytest.mark.slow),
    pytest.param(dict(tensor_parallel_size=2, enable_expert_parallel=True), id="tp2_ep")])
def test_qwen3_moe_parallel_matches_single_process(qwen3_moe_path, qwen3_moe_reference, parallel):
    """Real gloo worker processes: TP slices every expert, EP gives each rank 4 whole experts."""
    llm = LLM(model=qwen3_moe_path, **engine_kwargs(**parallel))
    tokens, logprobs = greedy_run(llm, prompts())
    llm.shutdown()
    assert tokens == qwen3_moe_reference[0]
    assert (logprobs - qwen3_moe_reference[1]).abs().max().item() <= 1e-4


@pytest.mark.requires_native
def test_bf16_decode_steps_replay_from_cpu_graphs(tmp_path):
    """QK-norm on [T, heads, d] views of the qkv output (the native norm reads them in place)
    plus the native MoE: decode steps of 2 sequences and of 1 are CPU graphs, equal to eager."""
    path = write_tiny_checkpoint(tmp_path, Qwen3MoeConfig, Qwen3MoeForCausalLM, seed=2,
                                 **{**TINY_MOE, "num_experts": 16})
    assert sorted(assert_cpu_graphs_replay_eager_steps(path, (6, 9)).entries) == [1, 2]
