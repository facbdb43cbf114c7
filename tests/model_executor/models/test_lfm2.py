"""LFM2 (gated short-convolution layers with a per-sequence state, beside GQA layers with QK
norm) against transformers: whole prompts, prompts in chunks (the state carried between a
sequence's steps), preemption (a recomputed sequence restarts its state), TP / PP."""

import pytest
from transformers import Lfm2Config, Lfm2ForCausalLM

from minivllm import LLM
from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_preemption_keeps_tokens,
                                                         assert_prefixes_clean, build_model,
                                                         write_tiny_checkpoint)
from tests.model_executor.models._family_helpers import STATE_BUDGETS

# Conv layers around one attention layer; the MLP width is LFM2's auto-adjusted one (64 here).
TINY_LFM2 = dict(rms_norm_eps=None, norm_eps=1e-5, tie_word_embeddings=True,
                 num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
                 intermediate_size=96, block_multiple_of=32)


@pytest.fixture(scope="module")
def lfm2_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lfm2"), Lfm2Config, Lfm2ForCausalLM,
                                 **TINY_LFM2)


@STATE_BUDGETS
def test_lfm2_matches_transformers(lfm2_path, budget):
    # 8 tokens per step: every prompt is prefilled in chunks beside other sequences' decodes.
    assert_matches_transformers(lfm2_path, max_num_batched_tokens=budget)


def test_lfm2_preempted_sequences_restart_their_state(lfm2_path):
    assert_preemption_keeps_tokens(lfm2_path)


def test_lfm2_prefixes_and_bad_names(lfm2_path, tmp_path):
    model = build_model(lfm2_path)
    assert model.is_hybrid and len(model.model.layers[0].conv.conv_state) >= 1
    assert_prefixes_clean(lfm2_path, "Lfm2ForCausalLM")
    assert_bad_names_reported(lfm2_path, tmp_path / "broken",
                              drop=["model.layers.2.conv.conv.weight",
                                    "model.layers.1.self_attn.q_layernorm.weight"])


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_lfm2_parallel_matches_one_process(lfm2_path, parallel):
    # TP splits the conv channels (in_proj's B / C / x blocks, the kernels, each rank's state).
    assert_parallel_matches_one_process(lfm2_path, **parallel)


def test_lfm2_serves_peft_adapters(lfm2_path, tmp_path):
    """LoRA on both mixers (attention q / v / out_proj, the conv's fused in_proj and out_proj)
    and the MLP gives transformers + PEFT's tokens."""
    from minivllm.lora.request import LoRARequest
    from tests.lora._lora_helpers import assert_adapter_matches_peft, write_adapter

    targets = ["q_proj", "v_proj", "out_proj", "in_proj", "w1", "w2"]
    adapter = write_adapter(lfm2_path, str(tmp_path / "lfm2"), 2, targets)
    llm = LLM(lfm2_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4, num_gpu_blocks_override=64, max_model_len=64)
    prompts = [[5, 17, 300, 42, 7, 99, 3, 250, 11], [400, 8, 61, 2, 77]]
    assert_adapter_matches_peft(llm, lfm2_path, adapter, prompts, LoRARequest("lfm2", 1, adapter))


def test_check_model_passes_on_lfm2_at_tp2(lfm2_path):
    """`minivllm check-model --hf -tp 2`: the fused in_proj (one checkpoint name for three
    shards) satisfies the packed-modules contract; every section passes."""
    from minivllm.entrypoints.check_model import CheckOptions, run_checks

    report = run_checks(CheckOptions(lfm2_path, hf=True, tensor_parallel_size=2))
    assert {s.status for s in report.sections.values()} == {"pass"}, report.to_text()
