"""vLLM 0.33.0's own Gated DeltaNet files on minivllm, against transformers: qwen3_next.py
(Qwen3-Next: Gated DeltaNet linear-attention layers with a per-sequence conv + recurrent state
beside gated full-attention layers, MoE MLPs with a gated shared expert) with whole prompts,
prompts in chunks of 8 beside other sequences' decodes, forced preemption, and TP=2 over real
processes; olmo_hybrid.py (separate q / k / v / gate projections and convs, beta in (0, 2))
whole and chunked, and at TP=2.

The files come from vLLM's source distribution on PyPI (see `_vllm_files`).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (OlmoHybridConfig, OlmoHybridForCausalLM, Qwen3NextConfig,
                          Qwen3NextForCausalLM)

from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (TINY_DENSE,
                                                         assert_matches_transformers,
                                                         assert_preemption_keeps_tokens,
                                                         build_model, make_prompts,
                                                         write_tiny_checkpoint)
from tests.model_executor.models._family_helpers import STATE_BUDGETS

# linear / full / linear attention; 2 key heads serving 4 value heads (grouped), 4 experts
# top-2 and a shared expert (a dense MLP on layer 1); partial RoPE (half of each head
# rotated), as Qwen3-Next has it.
TINY_QWEN3_NEXT = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_hidden_layers=3, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    decoder_sparse_step=1, mlp_only_layers=[1],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.5})
# 2 key heads of 16 serving 4 value heads of 16: the q / k / v convs differ in width.
TINY_OLMO_HYBRID = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_hidden_layers=3, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
# A 70-token prompt: its whole-prompt prefill runs the chunked rule over two chunks of 64.
# 12 generated tokens keep transformers' full recompute per token cheap.
PROMPTS = make_prompts(TINY_DENSE["vocab_size"], (5, 17, 70))
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3_next_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next"), Qwen3NextConfig,
                                 Qwen3NextForCausalLM, **TINY_QWEN3_NEXT)


@STATE_BUDGETS
def test_vllm_qwen3_next_file_matches_transformers(qwen3_next_path, registered_vllm_class,
                                                   budget):
    cls = registered_vllm_class("qwen3_next", "Qwen3NextForCausalLM", None)
    model = build_model(qwen3_next_path)
    assert type(model) is cls and model.is_hybrid and "._checked_qwen3_next_" in cls.__module__
    gdn = model.model.layers[0].linear_attn
    # vLLM's state layout: conv [slots, K - 1, 2 hk dk + hv dv], recurrent [slots, hv, dv, dk]
    assert gdn.conv_state.shape[1:] == (3, 2 * 2 * 16 + 4 * 16)
    assert gdn.ssm_state.shape[1:] == (4, 16, 16)
    assert_matches_transformers(qwen3_next_path, prompts=PROMPTS, num_tokens=NUM_TOKENS,
                                max_num_batched_tokens=budget)


@pytest.mark.slow      # ~15-30 s: transformers' references for 6 prompts of 24 tokens
def test_vllm_qwen3_next_preempted_sequences_restart_their_state(qwen3_next_path,
                                                                 registered_vllm_class):
    registered_vllm_class("qwen3_next", "Qwen3NextForCausalLM", None)
    assert_preemption_keeps_tokens(qwen3_next_path)


def test_vllm_qwen3_next_file_at_tp2_equals_one_process(qwen3_next_path,
                                                        registered_vllm_class):
    from minivllm.entrypoints.check_model.build import model_file_plugin
    from tests.model_executor.models._vllm_files import vllm_models_dir

    registered_vllm_class("qwen3_next", "Qwen3NextForCausalLM", None)
    # Each rank holds one key head and its two value heads, half of every [q | k | v] conv
    # segment; the worker processes register vLLM's class through a general plugin.
    with model_file_plugin(f"{vllm_models_dir() / 'qwen3_next'}.py:Qwen3NextForCausalLM",
                           "Qwen3NextForCausalLM"):
        assert_parallel_matches_one_process(qwen3_next_path, tensor_parallel_size=2)


def test_qwen3_next_bf16_with_fp32_recurrent_state(qwen3_next_path, registered_vllm_class):
    """bf16 weights with an fp32 recurrent state (`--mamba-ssm-cache-dtype float32`) run and
    keep the dtypes asked for."""
    from minivllm import LLM, SamplingParams

    registered_vllm_class("qwen3_next", "Qwen3NextForCausalLM", None)
    llm = LLM(model=qwen3_next_path, dtype="bfloat16", mamba_ssm_cache_dtype="float32",
              block_size=4, num_gpu_blocks_override=64, max_model_len=128)
    gdn = llm.llm_engine.executor.worker.model_runner.model.model.layers[0].linear_attn
    assert (gdn.conv_state.dtype, gdn.ssm_state.dtype) == (torch.bfloat16, torch.float32)
    out = llm.generate([[5, 17, 300, 42]], SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def _as_hub_layout(path: str, key_dim: int, value_dim: int) -> str:
    """transformers 5 saves OLMo hybrid under its original names, renaming the linear layers'
    norms to attention_layer_norm / feedforward_layer_norm and cutting the fused conv into
    three equal thirds. vLLM's file reads the norms by their module names and q_conv1d /
    k_conv1d / v_conv1d as [key_dim, key_dim, value_dim]: rewrite the file that way (transformers
    loads both layouts: its renames and concatenation find their sources or do nothing)."""
    file = Path(path) / "model.safetensors"
    renames = {"attention_layer_norm": "input_layernorm",
               "feedforward_layer_norm": "post_attention_layernorm"}
    state = {}
    for name, tensor in load_file(file).items():
        for old, new in renames.items():
            name = name.replace(old, new)
        state[name] = tensor
    for name in [n for n in state if n.endswith("q_conv1d.weight")]:
        base = name[:-len("q_conv1d.weight")]
        fused = torch.cat([state.pop(f"{base}{p}_conv1d.weight") for p in "qkv"])
        for p, part in zip("qkv", fused.split([key_dim, key_dim, value_dim])):
            state[f"{base}{p}_conv1d.weight"] = part.contiguous()
    save_file(state, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def olmo_hybrid_path(tmp_path_factory) -> str:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("olmo_hybrid"), OlmoHybridConfig,
                                 OlmoHybridForCausalLM, **TINY_OLMO_HYBRID)
    return _as_hub_layout(path, key_dim=2 * 16, value_dim=4 * 16)


@STATE_BUDGETS
def test_vllm_olmo_hybrid_file_matches_transformers(olmo_hybrid_path, registered_vllm_class,
                                                    budget):
    cls = registered_vllm_class("olmo_hybrid", "OlmoHybridForCausalLM", None)
    model = build_model(olmo_hybrid_path)
    assert type(model) is cls and model.is_hybrid
    assert model.model.layers[0].linear_attn.allow_neg_eigval      # beta = 2 sigmoid(b)
    assert_matches_transformers(olmo_hybrid_path, prompts=PROMPTS, num_tokens=NUM_TOKENS,
                                max_num_batched_tokens=budget)


@pytest.mark.slow      # the TP=2 split is qwen3_next's; OLMo adds q / k norms gathered over TP
def test_vllm_olmo_hybrid_file_at_tp2_equals_one_process(olmo_hybrid_path,
                                                         registered_vllm_class):
    from minivllm.entrypoints.check_model.build import model_file_plugin
    from tests.model_executor.models._vllm_files import vllm_models_dir

    registered_vllm_class("olmo_hybrid", "OlmoHybridForCausalLM", None)
    with model_file_plugin(f"{vllm_models_dir() / 'olmo_hybrid'}.py:OlmoHybridForCausalLM",
                           "OlmoHybridForCausalLM"):
        assert_parallel_matches_one_process(olmo_hybrid_path, tensor_parallel_size=2)


@pytest.mark.parametrize("file, arch", [("qwen3_next", "Qwen3NextForCausalLM"),
                                        ("olmo_hybrid", "OlmoHybridForCausalLM")])
def test_check_model_passes_on_vllm_gdn_files(request, file, arch):
    """`minivllm check-model --model-file <vLLM>/<file>.py:<arch> --hf`: every section passes,
    module by module against transformers; TP sizes must split the 2 linear key heads."""
    from minivllm.entrypoints.check_model import CheckOptions, run_checks
    from tests.model_executor.models._vllm_files import vllm_models_dir

    report = run_checks(CheckOptions(request.getfixturevalue(f"{file}_path"), hf=True,
                                     model_file=f"{vllm_models_dir() / file}.py:{arch}"))
    assert {s.status for s in report.sections.values()} == {"pass"}, report.to_text()
    assert "valid TP sizes [1, 2];" in report.sections["parallel"].summary
