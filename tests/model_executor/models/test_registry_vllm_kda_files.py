"""vLLM 0.33.0's Kimi Delta Attention files on minivllm, against transformers:
bailing_moe_v3.py (Ling 3.0: KDA linear-attention layers with short q / k / v convs, a per
channel forget gate and a write strength, beside MLA layers with a per-head output gate; MoE
MLPs with grouped sigmoid routing and a shared expert) against transformers'
BailingHybridForCausalLM, the same architecture, with whole prompts, prompts in chunks of 8
beside other sequences' decodes, and forced preemption. vLLM's file drives the KDA state ops
itself (`third_party/flash_linear_attention/ops/kda.py`, metadata from `gdn_attn.py`).

Two conventions differ between the hub checkpoint vLLM's file reads and what transformers 5
saves, and the test uses vLLM's (the hub's):
- transformers' converter renames the attention output `dense` to `o_proj` on load for every
  layer and back on save, so its files call the KDA output `dense`; the hub (and vLLM) call it
  `o_proj` in KDA layers and `dense` in MLA layers. The saved file is rewritten that way
  (transformers loads both: its rename finds nothing to do in KDA layers).
- `BailingHybridConfig` reads the KDA head width from `head_dim` and then overwrites
  `head_dim` with the MLA rope width; vLLM's file reads the KDA width from `head_dim`. The tiny
  config keeps the two equal (16), where both readings agree.
vLLM's file also reads fields transformers' config lacks, given as extra config fields:
`gated_attention_proj_granularity_type="head_wise"` (transformers' MLA always gates per
head), `moe_shared_expert_intermediate_size`, `use_bias` and `no_kda_lora`.

The files come from vLLM's source distribution on PyPI (see `_vllm_files`).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BailingHybridConfig, BailingHybridForCausalLM

from minivllm import LLM
from minivllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
from tests.model_executor.models._family_helpers import (TINY_DENSE,
                                                         assert_matches_transformers,
                                                         assert_preemption_keeps_tokens,
                                                         build_model, hf_greedy, make_prompts,
                                                         minivllm_greedy, write_tiny_checkpoint)
from tests.model_executor.models._family_helpers import STATE_BUDGETS

# KDA, KDA, MLA (layer_group_size 3: every third layer is full attention); layer 0 a dense
# MLP, 1-2 MoE (4 experts in 2 groups, top-2 from the best group, and a shared expert).
# 4 KDA heads of 16; MLA without a q LoRA, rope width 16 = the KDA head width (see above).
TINY_BAILING_V3 = dict(
    num_hidden_layers=3, layer_group_size=3, num_attention_heads=4, num_key_value_heads=4,
    head_dim=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32,
    q_lora_rank=None, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, num_mtp_layers=0,
    routed_scaling_factor=2.5, short_conv_kernel_size=4,
    gated_attention_proj_granularity_type="head_wise", moe_shared_expert_intermediate_size=32,
    use_bias=False, no_kda_lora=True)
# A 70-token prompt: its whole-prompt prefill runs the chunked rule over two chunks of 64.
PROMPTS = make_prompts(TINY_DENSE["vocab_size"], (5, 17, 70))
NUM_TOKENS = 8


def _as_hub_layout(path: str) -> str:
    """The KDA layers' output projection under the hub's name, `o_proj` (see above)."""
    file = Path(path) / "model.safetensors"
    state = load_file(file)
    kda_layers = {name.split("attention.")[0] for name in state if "q_conv1d" in name}
    renamed = {}
    for name, tensor in state.items():
        if name.split("attention.")[0] in kda_layers:
            name = name.replace("attention.dense.", "attention.o_proj.")
        renamed[name] = tensor
    save_file(renamed, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def bailing_v3_path(tmp_path_factory) -> str:
    return _as_hub_layout(write_tiny_checkpoint(tmp_path_factory.mktemp("bailing_v3"),
                                                BailingHybridConfig, BailingHybridForCausalLM,
                                                **TINY_BAILING_V3))


@pytest.fixture(scope="module")
def bailing_v3_reference(bailing_v3_path) -> list:
    """transformers' greedy tokens and logprobs, computed once for both batch budgets."""
    return hf_greedy(bailing_v3_path, PROMPTS, NUM_TOKENS)


@STATE_BUDGETS
def test_vllm_bailing_moe_v3_file_matches_transformers(bailing_v3_path, bailing_v3_reference,
                                                       registered_vllm_class, budget):
    """fp32 greedy tokens identical, every prompt and sampled logprob within 1e-4 (what
    `assert_matches_transformers` checks, against the shared reference)."""
    cls = registered_vllm_class("bailing_moe_v3", "BailingHybridForCausalLM",
                                "BailingMoeV3ForCausalLM")
    model = build_model(bailing_v3_path)
    assert type(model) is cls and model.is_hybrid and "._checked_bailing_moe_v3_" in cls.__module__
    kda, mla = model.model.layers[0].self_attn, model.model.layers[2].self_attn
    assert type(kda).__name__ == "BailingMoeV3KimiDeltaAttention"
    assert type(mla).__name__ == "BailingMoeV3MLAAttention" and mla.g_proj is not None
    # vLLM's state shapes: conv [K - 1, 3 * heads * d] (sequence-major), recurrent [h, d, d];
    # the recurrent state stays fp32 under a bf16 model (vLLM's KDA rule)
    assert kda.get_state_shape() == ((3, 3 * 4 * 16), (4, 16, 16))
    assert MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto") == \
        (torch.bfloat16, torch.float32)
    llm = LLM(model=bailing_v3_path, dtype="float32", block_size=4,
              max_num_batched_tokens=budget, max_num_seqs=4)
    ours = minivllm_greedy(llm, PROMPTS, NUM_TOKENS)
    # The runner gave the KDA layers their states on `kv_cache` (a row per sequence slot),
    # left them out of the paged KV cache, and the run wrote them.
    runner = llm.llm_engine.executor.worker.model_runner
    assert set(runner.mamba_layers) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert set(runner.attn_layers) == {"model.layers.2.self_attn.attn"}
    conv, recurrent = runner.mamba_layers["model.layers.0.self_attn"].kv_cache
    assert conv.shape == (4, 3, 192) and recurrent.shape == (4, 4, 16, 16)
    assert recurrent.dtype == torch.float32 and recurrent.abs().sum() > 0
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, bailing_v3_reference)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: logprobs differ by {diff:.3g} (> 1e-4)"


@pytest.mark.slow      # ~15-30 s: transformers' references for 6 prompts of 24 tokens
def test_vllm_bailing_moe_v3_preempted_sequences_restart_their_state(bailing_v3_path,
                                                                     registered_vllm_class):
    registered_vllm_class("bailing_moe_v3", "BailingHybridForCausalLM",
                          "BailingMoeV3ForCausalLM")
    assert_preemption_keeps_tokens(bailing_v3_path)


@pytest.mark.slow      # ~10-15 s; the gate alone: tests/third_party/flash_linear_attention/ops/test_kda.py
def test_vllm_bailing_moe_v3_softplus_gate_matches_transformers(tmp_path,
                                                                registered_vllm_class):
    """kda_safe_gate=False: the unbounded forget gate -exp(A) softplus(f + dt_bias)."""
    registered_vllm_class("bailing_moe_v3", "BailingHybridForCausalLM",
                          "BailingMoeV3ForCausalLM")
    path = _as_hub_layout(write_tiny_checkpoint(tmp_path, BailingHybridConfig,
                                                BailingHybridForCausalLM,
                                                **{**TINY_BAILING_V3, "kda_safe_gate": False}))
    assert not build_model(path).model.layers[0].self_attn.safe_gate
    assert_matches_transformers(path, prompts=PROMPTS[1:], num_tokens=8)
