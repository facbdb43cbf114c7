"""More of vLLM 0.33.0's own text-model files, import root renamed, run on minivllm against
transformers 5's classes for the same families: exaone.py (EXAONE 3, GPT-2-style names),
hyperclovax.py (muP multipliers, post-norms), minicpm3.py (MLA with scaled embeddings and
residuals), afmoe.py (gated attention, sliding windows, a dense first layer, sigmoid routing with
a correction bias, shared experts, route scaling), lfm2_moe.py (short-convolution layers beside
attention, a dense first layer, biased sigmoid routing), laguna.py (per-layer head counts and
RoPE, gated attention, a routing bias the file hands the runner as a free Parameter), AXK1.py
(A.X K1: MLA, grouped biased sigmoid routing, shared experts, post-MoE norms), sarvam.py's
two classes (Sarvam-MoE on vLLM's bailing_moe.py, with fused QKV and QK norms; Sarvam-MLA),
longcat_flash.py (LongCat-Flash: paired sublayers, scaled MLA, zero experts) and dory.py (Dory:
nGPT blocks on the unit sphere, recurrent middle blocks looped with a KV cache per loop).

Each file is registered over minivllm's class for its architecture; a tiny random checkpoint of
the family runs through `LLM`: fp32 greedy tokens identical and prompt logprobs within 1e-4
(the checks of `assert_matches_transformers`), the stateful ones also in prompt chunks of 8
tokens beside other sequences' decodes (against the same transformers run). Routing biases start
at zero in transformers: they are made random, so a dropped one shows. Zamba2 has its own file
(test_registry_vllm_zamba2_file.py); dbrx.py fails to load in vLLM 0.33 itself (see its test).

Not covered, for want of a transformers reference that fits: param2moe.py (written for the
released remote-code config: it reads `config.rope_theta`, which transformers 5's Param2MoeConfig
folds into `rope_parameters`, so it fails in vLLM the same way), and minicpm.py, solar.py,
orion.py, telechat2.py, step1.py, plamo3.py, mimo.py, bailing_moe.py (no transformers 5.25
causal-LM class; solar_open is another file's family).
"""

import json
import os
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from minivllm import LLM
from tests.model_executor.models._family_helpers import (build_model, hf_greedy, make_prompts,
                                                         minivllm_greedy, write_tiny_checkpoint)

_MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
# Sarvam: grouped sigmoid routing with a correction bias, routed scaling, a shared expert, a dense
# first layer.
_SARVAM = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, num_shared_experts=1, moe_shared_expert_intermediate_size=32,
               first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
               embedding_dropout=0.0)
# case -> (vLLM file, transformers config class, vLLM's class, config overrides)
FAMILIES = {
    # transformers runs EXAONE 3 as Llama (renaming the weights on load, back on save).
    "exaone": ("exaone", "ExaoneConfig", "ExaoneForCausalLM", dict(head_dim=16)),
    # Every muP multiplier away from 1, and the Peri-LN post-norms.
    "hyperclovax": ("hyperclovax", "HyperCLOVAXConfig", "HyperCLOVAXForCausalLM",
                    dict(head_dim=16, embedding_multiplier=1.3, logits_scaling=0.7,
                         residual_multiplier=0.8, attention_multiplier=0.2,
                         use_post_norm=True)),
    "minicpm3": ("minicpm3", "MiniCPM3Config", "MiniCPM3ForCausalLM",
                 dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, num_key_value_heads=4, scale_emb=2, scale_depth=1.4,
                      dim_model_base=32, head_dim=None)),
    # score_func / route_norm / n_group / topk_group: the released checkpoints' config fields
    # vLLM's file reads (transformers' class hard-codes the same: sigmoid, normalised, 1 group).
    "afmoe": ("afmoe", "AfmoeConfig", "AfmoeForCausalLM",
              dict(_MOE, head_dim=16, num_dense_layers=1, num_shared_experts=1, route_scale=2.0,
                   sliding_window=8, global_attn_every_n_layers=2,
                   layer_types=["sliding_attention", "full_attention"], score_func="sigmoid",
                   route_norm=True, n_group=1, topk_group=1)),
    # vLLM's LFM2-MoE always ties the LM head to the embedding, as its checkpoints do.
    "lfm2_moe": ("lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 dict(_MOE, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                      num_dense_layers=1, routed_scaling_factor=1.5, norm_eps=1e-5,
                      rms_norm_eps=None, use_expert_bias=True, tie_word_embeddings=True)),
    # Window-8 layers with full RoPE beside global ones with half rotary and 8 heads.
    "laguna": ("laguna", "LagunaConfig", "LagunaForCausalLM",
               dict(_MOE, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"],
                    mlp_layer_types=["dense", "sparse"], shared_expert_intermediate_size=48,
                    num_attention_heads_per_layer=[4, 8], moe_routed_scaling_factor=2.0,
                    rope_parameters={
                        "full_attention": {"rope_type": "default", "rope_theta": 500000.0,
                                           "partial_rotary_factor": 0.5},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 1.0}})),
    # A.X K1 (DeepSeek-V3-like): MLA, grouped sigmoid routing with a correction bias, a shared
    # expert, a dense first layer, and a norm after each MoE block.
    "AXK1": ("AXK1", "AXK1Config", "AXK1ForCausalLM",
             dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                  num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, mlp_layer_types=["dense", "sparse"])),
    # Sarvam's two files' classes, written for the released checkpoints' remote-code configs:
    # their fields (`num_shared_experts`, `moe_shared_expert_intermediate_size`, ...) go into
    # config.json beside transformers' own (which transformers 5 keeps as extra attributes).
    # transformers runs them as GLM-4-MoE / DeepSeek-V3, renaming the weights on load and back
    # to the released names (`attention.query_key_value`, `mlp.gate.expert_bias`) on save.
    "sarvam_moe": ("sarvam", "SarvamMoEConfig", "SarvamMoEForCausalLM",
                   dict(_SARVAM, head_dim=16, use_qk_norm=True, use_rmsnorm=True,
                        use_bias=False, use_qkv_bias=False, router_dtype="fp32",
                        moe_router_enable_expert_bias=True, score_function="sigmoid")),
    "sarvam_mla": ("sarvam", "SarvamMLAConfig", "SarvamMLAForCausalLM",
                   dict(_SARVAM, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    # LongCat-Flash: two attention + MLP pairs per layer with a MoE beside them, MLA whose
    # LoRA norms carry a scale (folded into their weight loaders), 8 experts plus 2 weightless
    # "zero" (identity) experts, softmax routing with a correction bias, routed scaling. The
    # released config's `mla_scale_*` / `zero_expert_type` fields are what transformers' class
    # hard-codes; its RoPE runs at `head_dim`, so that is the rope head size.
    "longcat_flash": ("longcat_flash", "LongcatFlashConfig", "LongcatFlashForCausalLM",
                      dict(num_layers=2, num_hidden_layers=None, intermediate_size=None,
                           num_key_value_heads=None, ffn_hidden_size=96, q_lora_rank=24,
                           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
                           v_head_dim=16, moe_topk=2, n_routed_experts=8, zero_expert_num=2,
                           expert_ffn_hidden_size=32, routed_scaling_factor=2.0,
                           mla_scale_q_lora=True, mla_scale_kv_lora=True,
                           zero_expert_type="identity")),
    # Dory (nGPT on the unit sphere): 2 input blocks, 4 recurrent ones run twice, 2 output
    # blocks; window-8 and global attention blocks, each followed by an MLP block. The config
    # counts blocks (vLLM's reading, `configs/dory.py`); the weights are put in the released
    # layout (`write_family_checkpoint`).
    "dory": ("dory", "DoryConfig", "DoryForCausalLM",
             dict(head_dim=16, sliding_window=8, num_hidden_layers=8, rms_norm_eps=None,
                  layer_types=["sliding_attention", "mlp", "full_attention", "mlp"] * 2,
                  n_input_layers=2, n_recurrent_layers=4, n_output_layers=2,
                  n_recurrent_loops=2,
                  rope_parameters={
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                      "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
}
# Tensors the released checkpoints carry and transformers does not write: A.X K1's dense layers
# store an (unused) post-MoE norm, which vLLM's file builds for every layer.
RELEASED_EXTRAS = {"AXK1": ["model.layers.0.post_mlp_layernorm.weight"]}
# Files whose layers keep per-sequence state (LFM2's convolutions, Dory's per-loop KV caches):
# also run in prompt chunks of 8 tokens beside other sequences' decodes.
STATEFUL = ("dory", "lfm2_moe")
NUM_TOKENS = 16
# Names of the routing-bias tensors transformers initialises to zero.
_ROUTING_BIASES = ("e_score_correction_bias", "expert_bias")


def write_family_checkpoint(folder, config_name: str, arch: str, extras: tuple[str, ...] = (),
                            **overrides) -> str:
    """A tiny random checkpoint of the family (`write_tiny_checkpoint`) with random routing
    biases, the `extras` (norm weights of ones) and vLLM's architecture name in config.json."""
    path = write_tiny_checkpoint(folder, getattr(transformers, config_name),
                                 transformers.AutoModelForCausalLM.from_config, **overrides)
    weights_file = os.path.join(path, "model.safetensors")
    state = load_file(weights_file)
    gen = torch.Generator().manual_seed(2)
    for name in state:
        if name.endswith(_ROUTING_BIASES):   # sigmoid scores ~0.5: 0.1 moves the choice
            state[name] = 0.1 * torch.randn(state[name].shape, generator=gen)
    for name in extras:
        state[name] = torch.ones(overrides.get("hidden_size", 64))
    if config_name == "DoryConfig":
        state = _released_dory_layout(state)
    save_file(state, weights_file, metadata={"format": "pt"})
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = [arch]
    with open(config_file, "w") as f:
        json.dump(config, f)
    return path


def _released_dory_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5.25 saves Dory in its load-time layout (one layer per attention + MLP pair;
    its reverse conversion is a TODO); the released checkpoints, which vLLM's file reads, store
    block 2i (`mixer` = attention, `attn_alpha`) and block 2i + 1 (`mixer` = MLP, `mlp_alpha`).
    Embedding rows get unit norm, as nGPT training keeps them: vLLM's file feeds them to the
    first block as they are, transformers normalises them first."""
    released = {}
    for name, tensor in state.items():
        match = re.match(r"backbone\.layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)(.*)$", name)
        if match:
            layer, part, rest = int(match[1]), match[2], match[3]
            block = 2 * layer + (part in ("mlp", "lambda_2"))
            part = {"lambda_1": "attn_alpha", "lambda_2": "mlp_alpha"}.get(part, "mixer")
            name = f"backbone.layers.{block}.{part}{rest}"
        elif name == "backbone.embeddings.weight":
            tensor = tensor / tensor.norm(dim=-1, keepdim=True)
        released[name] = tensor
    return released


# The slowest families (4-7 s each on 2 cores) run in the slow suite.
_SLOW_FAMILIES = {"lfm2_moe", "AXK1", "sarvam_mla"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c in _SLOW_FAMILIES else c for c in sorted(FAMILIES)])
def test_vllm_file_matches_transformers(case, registered_vllm_class, tmp_path):
    file, config_name, arch, overrides = FAMILIES[case]
    cls = registered_vllm_class(file, arch, None)
    assert f"._checked_{file}_" in cls.__module__      # vLLM's class, not minivllm's own
    path = write_family_checkpoint(tmp_path, config_name, arch, RELEASED_EXTRAS.get(file, ()),
                                   **overrides)
    state = load_file(os.path.join(path, "model.safetensors"))
    assert all(state[n].abs().sum() > 0 for n in state if n.endswith(_ROUTING_BIASES))
    assert type(build_model(path)) is cls              # the registry hands out vLLM's class
    prompts = make_prompts(1000, (5, 17, 40))
    reference = hf_greedy(path, prompts, NUM_TOKENS)   # computed once for every budget
    for budget in (512, 8) if case in STATEFUL else (512,):
        llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=budget)
        assert_same_greedy_run(minivllm_greedy(llm, prompts, NUM_TOKENS), reference)


def assert_same_greedy_run(ours: list, reference: list, atol: float = 1e-4) -> None:
    """`assert_matches_transformers`' checks on runs made apart: tokens identical, logprobs
    within `atol`."""
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, reference)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= atol, f"prompt {i}: logprobs differ by {diff:.3g} (> {atol})"


# DBRX: 4 experts of which 2 per token, QKV clipping. transformers 5.25's attention reads
# `attn_config.rope_theta`, a field its DbrxAttentionConfig lacks (DBRX's config.json has it).
_DBRX = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, hidden_size=None,
             intermediate_size=None, num_hidden_layers=None, num_attention_heads=None,
             num_key_value_heads=None, max_position_embeddings=None, rms_norm_eps=None,
             attn_config={"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
             ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})


def test_vllm_dbrx_file_fails_to_load_as_in_vllm(registered_vllm_class, tmp_path):
    """vLLM 0.33's dbrx.py loads no checkpoint, in vLLM as here: its load_weights maps the experts
    to `ffn.experts.w13_weight`, but since vLLM's MoERunner refactor they live at
    `ffn.experts.routed_experts.w13_weight` (vllm-project/vllm#49004, open). minivllm keeps
    vLLM's parameter names, so the same KeyError shows; the file is not compared further."""
    registered_vllm_class("dbrx", "DbrxForCausalLM", None)
    path = write_family_checkpoint(tmp_path, "DbrxConfig", "DbrxForCausalLM", **_DBRX)
    with pytest.raises(KeyError, match=r"blocks\.0\.ffn\.experts\.w13_weight"):
        build_model(path)
