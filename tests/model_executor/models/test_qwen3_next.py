"""minivllm's own Qwen3-Next file (Gated DeltaNet linear-attention layers with per-sequence
state beside gated full-attention layers; MoE with a gated shared expert) against transformers:
whole prompts and chunks of 8, prefixes, bad names, TP=2, preemption (slow)."""

import pytest
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (TINY_DENSE, assert_bad_names_reported,
                                                         assert_preemption_keeps_tokens,
                                                         assert_prefixes_clean, build_model,
                                                         hf_greedy, make_prompts,
                                                         minivllm_greedy, write_tiny_checkpoint)
from tests.model_executor.models._family_helpers import STATE_BUDGETS

# linear / full / linear / full attention; 2 key heads serving 4 value heads; 4 experts top-2
# plus a shared expert, layer 1 dense (mlp_only_layers); half of each head rotated.
TINY_QWEN3_NEXT = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.5})
# The 70-token prompt's whole-prompt prefill runs the chunked delta rule over two chunks of 64.
PROMPTS = make_prompts(TINY_DENSE["vocab_size"], (5, 17, 70))
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3_next_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next_own"), Qwen3NextConfig,
                                 Qwen3NextForCausalLM, **TINY_QWEN3_NEXT)


@pytest.fixture(scope="module")
def qwen3_next_reference(qwen3_next_path) -> list:
    return hf_greedy(qwen3_next_path, PROMPTS, NUM_TOKENS)


def assert_matches_reference(path: str, reference: list, budget: int,
                             prompts: list[list[int]] = PROMPTS,
                             num_tokens: int = NUM_TOKENS) -> None:
    """`assert_matches_transformers` against a reference computed once per checkpoint
    (transformers' full recompute per token is most of these tests' time): fp32 greedy
    tokens identical, every prompt and generated logprob within 1e-4."""
    from minivllm import LLM

    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=budget)
    ours = minivllm_greedy(llm, prompts, num_tokens)
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, reference)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: logprobs differ by {diff:.3g}"


@STATE_BUDGETS
def test_qwen3_next_matches_transformers(qwen3_next_path, qwen3_next_reference, budget):
    assert_matches_reference(qwen3_next_path, qwen3_next_reference, budget)


def test_qwen3_next_is_minivllms_hybrid_moe(qwen3_next_path):
    from minivllm.model_executor.models.interfaces import is_mixture_of_experts

    model = build_model(qwen3_next_path)
    assert type(model).__module__ == "minivllm.model_executor.models.qwen3_next"
    assert model.is_hybrid and model.has_inner_state and is_mixture_of_experts(model)
    assert (model.num_moe_layers, model.num_logical_experts) == (3, 4)
    gdn = model.model.layers[0].linear_attn
    # conv [slots, K - 1, 2 hk dk + hv dv], recurrent [slots, hv, dv, dk] (vLLM's layout)
    assert gdn.conv_state.shape[1:] == (3, 2 * 2 * 16 + 4 * 16)
    assert gdn.ssm_state.shape[1:] == (4, 16, 16)
    assert len(model.get_expert_mapping()) == 3 * 4


def test_qwen3_next_prefixes_and_bad_names(qwen3_next_path, tmp_path):
    assert_prefixes_clean(qwen3_next_path, "Qwen3NextForCausalLM")
    assert_bad_names_reported(
        qwen3_next_path, tmp_path / "broken",
        drop=["model.layers.0.linear_attn.A_log", "model.layers.3.self_attn.q_norm.weight",
              "model.layers.2.mlp.shared_expert_gate.weight"])


def test_qwen3_next_mtp_weights_are_skipped(qwen3_next_path, tmp_path):
    """Checkpoints carry the multi-token-prediction draft's weights under `mtp.`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(qwen3_next_path, tmp_path / "with_mtp")
    file = tmp_path / "with_mtp" / "model.safetensors"
    state = load_file(file)
    state["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(state, file, metadata={"format": "pt"})
    build_model(str(tmp_path / "with_mtp"))


def test_qwen3_next_bf16_with_fp32_recurrent_state(qwen3_next_path):
    """bf16 weights with an fp32 recurrent state (`--mamba-ssm-cache-dtype float32`) run."""
    import torch

    from minivllm import LLM, SamplingParams

    llm = LLM(model=qwen3_next_path, dtype="bfloat16", mamba_ssm_cache_dtype="float32",
              block_size=4, num_gpu_blocks_override=64, max_model_len=128)
    gdn = llm.llm_engine.executor.worker.model_runner.model.model.layers[0].linear_attn
    assert (gdn.conv_state.dtype, gdn.ssm_state.dtype) == (torch.bfloat16, torch.float32)
    out = llm.generate([[5, 17, 300, 42]], SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.slow      # ~8 s: module-by-module against transformers, TP sizes, dummy runs
def test_check_model_passes_on_own_qwen3_next(qwen3_next_path):
    """`minivllm check-model <folder> --hf` on minivllm's own file: every section passes."""
    from minivllm.entrypoints.check_model import CheckOptions, run_checks

    report = run_checks(CheckOptions(qwen3_next_path, hf=True))
    assert {s.status for s in report.sections.values()} == {"pass"}, report.to_text()


@pytest.mark.slow   # vLLM's qwen3_next file at TP=2 stays in the default suite
def test_qwen3_next_at_tp2_equals_one_process(qwen3_next_path):
    # Each rank holds one key head with its two value heads, 2 of the 4 query heads (with their
    # gates) and one KV head, and a slice of every expert.
    assert_parallel_matches_one_process(qwen3_next_path, tensor_parallel_size=2)


@pytest.mark.slow      # ~15 s: transformers' references for 6 prompts of 24 tokens
def test_qwen3_next_preempted_sequences_restart_their_state(qwen3_next_path):
    assert_preemption_keeps_tokens(qwen3_next_path)


@pytest.mark.slow      # ~13 s; layers 0-1 on one stage, 2-3 (and their state slots) on the other
def test_qwen3_next_at_pp2_equals_one_process(qwen3_next_path):
    assert_parallel_matches_one_process(qwen3_next_path, pipeline_parallel_size=2)
