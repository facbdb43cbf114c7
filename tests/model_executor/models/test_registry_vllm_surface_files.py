"""vLLM 0.33.0's model files that needed more of vLLM's layer surface, run on minivllm against
transformers: fp32 greedy tokens identical, prompt logprobs within 1e-4 (the files come from
vLLM's source distribution, see `_vllm_files`).

- nemotron_h.py: Mamba-2, attention (no positions), relu2 MLP and non-gated relu2 MoE layers
  (`activation_without_mul`) with latent projections, grouped sigmoid routing, a correction
  bias and a routed scaling factor; whole prompts, chunks of 8, forced preemption.
- minimax_m2.py: q / k RMSNorm over all heads (`layers/minimax_rms_norm`), partial RoPE,
  sigmoid routing with a correction bias.
- cohere2_moe.py (`compilation/breakable_cudagraph`): sliding-window layers with RoPE beside
  position-free global ones, a dense first layer, sigmoid routing, an averaged shared expert,
  LayerNorm (vLLM's `commandr.LayerNorm`). vLLM's file widens the window by one token (Cohere's
  training convention, as its commandr.py), so transformers runs with window + 1.
- llama4.py (text): `ChunkedLocalAttention` with chunks of 16 (shorter than the prompts), NoPE
  layers with attention temperature tuning (floor_scale 8, so it acts on these short prompts),
  QK norm, top-1 sigmoid MoE with a shared expert, fused expert tensors.
- gemma4.py (text): sliding / global layers with their own head sizes and KV heads, k = v on
  global layers, proportional partial RoPE, per-layer input embeddings, MoE beside the MLP,
  KV-sharing last layers, final logit soft-capping.
- hy_v3.py (`layers.hpc`, whose fused RoPE + QK-norm says unsupported, so the file's own path
  runs): QK norm before RoPE, a dense first layer, sigmoid routing with an expert bias, routed
  scaling, a shared expert. Its config fields (expert_hidden_dim, route_norm, qk_norm,
  first_k_dense_replace) are the original HunYuan checkpoint's, which transformers' HYV3Config
  keeps as extra keys.
- mimo_v2.py (`str_dtype_to_torch_dtype`, `scaled_quantize`, the backend registry's names):
  full layers beside sliding ones with twice the KV heads and attention sinks, a value scale,
  partial RoPE with per-type bases, grouped sigmoid routing with a correction bias. The config
  carries transformers' fields and the original checkpoint's (hybrid_layer_pattern,
  swa_num_key_value_heads, sliding_window_size, ...), which vLLM's file reads. Q / K and V head
  sizes are equal: MiMo's larger Q / K heads take vLLM's DiffKV GPU backends, which minivllm
  does not have. vLLM's file attends `sliding_window_size` tokens where transformers attends
  one more (its config adds 1), so transformers runs with the window vLLM uses.

Every transformers reference is computed once per checkpoint and compared with each engine
setting; ~60 s on 2 cores.
"""

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.model_executor.models._family_helpers import (assert_preemption_keeps_tokens,
                                                         build_model, hf_greedy, make_prompts,
                                                         minivllm_greedy,
                                                         write_tiny_checkpoint)

TINY_NEMOTRON_H = dict(
    layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention",
                       "moe"],
    num_hidden_layers=None, rms_norm_eps=None, layer_norm_epsilon=1e-5, head_dim=16,
    mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16,
    conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48, moe_latent_size=40, n_group=2, topk_group=1,
    routed_scaling_factor=2.5)
TINY_MINIMAX_M2 = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                       head_dim=16, rotary_dim=8, scoring_func="sigmoid",
                       use_routing_bias=True)
TINY_COHERE2_MOE = dict(
    num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"], sliding_window=16, head_dim=16,
    intermediate_size=32, prefix_dense_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, num_shared_experts=1, shared_expert_combination_strategy="average",
    expert_selection_fn="sigmoid", logit_scale=0.5, tie_word_embeddings=True,
    rms_norm_eps=None, layer_norm_eps=1e-5)
TINY_LLAMA4 = dict(num_hidden_layers=4, head_dim=16, no_rope_layer_interval=2,
                   attention_chunk_size=16, interleave_moe_layer_step=2, num_local_experts=4,
                   num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=128,
                   use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8,
                   attn_scale=0.1)
TINY_GEMMA4 = dict(
    num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=16, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
    attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=1000, enable_moe_block=True, num_experts=4, top_k_experts=2,
    moe_intermediate_size=32, final_logit_softcapping=30.0, tie_word_embeddings=True)
TINY_HY_V3 = dict(num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  num_shared_experts=1, moe_intermediate_size=32, expert_hidden_dim=32,
                  route_norm=True, qk_norm=True, first_k_dense_replace=1,
                  router_scaling_factor=2.5)

# Past the 16-token windows / chunks, prompts and their completions; shorter than the family
# tests' so that transformers' references (full recomputes) stay cheap.
PROMPTS = make_prompts(1000, (5, 17, 33, 40))
NUM_TOKENS = 16

TINY_MIMO_V2 = dict(
    num_hidden_layers=4, head_dim=16, v_head_dim=16, num_key_value_heads=1,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=17,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
    topk_group=1, norm_topk_prob=True, attention_value_scale=0.8,
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e6,
                                        "partial_rotary_factor": 0.5},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                           "partial_rotary_factor": 0.5}},
    # The same model in the original checkpoint's names (what vLLM's file reads).
    hybrid_layer_pattern=[0, 1, 1, 0], moe_layer_freq=[0, 1, 1, 1], swa_num_attention_heads=4,
    swa_num_key_value_heads=2, swa_head_dim=16, swa_v_head_dim=16, sliding_window_size=16,
    add_swa_attention_sink_bias=True, layernorm_epsilon=1e-5, rope_theta=5e6,
    swa_rope_theta=1e4, partial_rotary_factor=0.5)

# vLLM file -> (transformers class, config class, overrides, reference config changes)
FILES = {
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", TINY_NEMOTRON_H, None),
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config", TINY_MINIMAX_M2, None),
    "cohere2_moe": ("Cohere2MoeForCausalLM", "Cohere2MoeConfig", TINY_COHERE2_MOE,
                    {"sliding_window": TINY_COHERE2_MOE["sliding_window"] + 1}),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", TINY_LLAMA4, None),
    "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig", TINY_GEMMA4, None),
    "hy_v3": ("HYV3ForCausalLM", "HYV3Config", TINY_HY_V3, None),
    # transformers sets sliding_window = sliding_window_size + 1 on load: 15 gives vLLM's 16.
    "mimo_v2": ("MiMoV2FlashForCausalLM", "MiMoV2FlashConfig", TINY_MIMO_V2,
                {"sliding_window": 16, "sliding_window_size": 15}),
}


def _write(folder: str, file: str) -> tuple[str, str]:
    """(minivllm's checkpoint, transformers' reference folder) for `file`'s family."""
    hf_name, config_name, overrides, reference_config = FILES[file]
    path = write_tiny_checkpoint(folder, getattr(transformers, config_name),
                                 getattr(transformers, hf_name), **overrides)
    _randomise_correction_biases(path)
    if file == "llama4":
        _enable_temperature_tuning(path)
    if reference_config is None:
        return path, path
    reference = f"{path}_reference"
    shutil.copytree(path, reference)
    config = json.loads(open(os.path.join(reference, "config.json")).read())
    with open(os.path.join(reference, "config.json"), "w") as f:
        json.dump({**config, **reference_config}, f)
    return path, reference


def _randomise_correction_biases(path: str) -> None:
    """Routing-bias buffers start at zero: random ones show whether they steer the choice."""
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    gen = torch.Generator().manual_seed(3)
    for name in state:
        if "e_score_correction_bias" in name or name.endswith(".expert_bias"):
            state[name] = 0.1 * torch.randn(state[name].shape, generator=gen)
    save_file(state, file, metadata={"format": "pt"})


def _enable_temperature_tuning(path: str) -> None:
    """vLLM's Llama 4 turns temperature tuning on from generation_config.json (or past 32k
    tokens); `_from_model_config` would make transformers drop the unknown field."""
    file = os.path.join(path, "generation_config.json")
    config = json.loads(open(file).read()) if os.path.exists(file) else {}
    config.pop("_from_model_config", None)
    with open(file, "w") as f:
        json.dump({**config, "attn_temperature_tuning": True}, f)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """`family(file)` -> (checkpoint, transformers' greedy reference), each built once."""
    built = {}

    def get(file: str):
        if file not in built:
            path, reference = _write(str(tmp_path_factory.mktemp(file)), file)
            built[file] = path, hf_greedy(reference, PROMPTS, NUM_TOKENS)
        return built[file]
    return get


def _assert_matches(path: str, ref: list, atol: float = 1e-4, **llm_kwargs) -> None:
    from minivllm import LLM

    kwargs = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 512, **llm_kwargs}
    ours = minivllm_greedy(LLM(model=path, **kwargs), PROMPTS, NUM_TOKENS)
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, ref)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= atol, f"prompt {i}: logprobs differ by {diff:.3g} (> {atol})"


# Whole prompts for every file; chunks of 8 for the hybrid and windowed / chunked ones.
CASES = [("nemotron_h", 512), ("nemotron_h", 8), ("minimax_m2", 512), ("cohere2_moe", 512),
         pytest.param("cohere2_moe", 8, marks=pytest.mark.slow), ("llama4", 512),
         ("llama4", 8), ("gemma4", 512), ("gemma4", 8), ("hy_v3", 512), ("mimo_v2", 512),
         ("mimo_v2", 8)]


@pytest.mark.parametrize("file, budget", CASES)
def test_vllm_surface_file_matches_transformers(file, budget, family, registered_vllm_class):
    cls = registered_vllm_class(file, FILES[file][0], None)
    path, ref = family(file)
    if budget == 512:
        assert type(build_model(path)) is cls and f"._checked_{file}_" in cls.__module__
    _assert_matches(path, ref, max_num_batched_tokens=budget)


def test_vllm_nemotron_h_preempted_sequences_restart_their_state(family,
                                                                  registered_vllm_class):
    registered_vllm_class("nemotron_h", "NemotronHForCausalLM", None)
    path, _ = family("nemotron_h")
    assert_preemption_keeps_tokens(path)


def test_vllm_file_layers_are_the_new_surface(family, registered_vllm_class):
    """The pieces these files came for are in place: non-gated experts, chunked-local layers
    only where RoPE is, KV-sharing layers reading their target's cache."""
    from minivllm import LLM
    from minivllm.model_executor.layers.attention import ChunkedLocalAttention

    registered_vllm_class("nemotron_h", "NemotronHForCausalLM", None)
    experts = build_model(family("nemotron_h")[0]).model.layers[1].mixer.experts.routed_experts
    assert experts.activation == "relu2_no_mul" and experts.w13_weight.shape[1] == 32
    registered_vllm_class("llama4", "Llama4ForCausalLM", None)
    layers = build_model(family("llama4")[0]).model.layers
    assert [isinstance(layer.self_attn.attn, ChunkedLocalAttention) for layer in layers] == \
        [True, False, True, False]
    assert [layer.self_attn.attn_temperature_tuning for layer in layers] == \
        [False, True, False, True]
    registered_vllm_class("gemma4", "Gemma4ForCausalLM", None)
    llm = LLM(model=family("gemma4")[0], dtype="float32", block_size=4,
              num_gpu_blocks_override=32, max_model_len=128)
    attn = llm.llm_engine.executor.worker.model_runner.attn_layers
    assert attn["model.layers.2.self_attn.attn"].kv_cache is \
        attn["model.layers.0.self_attn.attn"].kv_cache
    assert attn["model.layers.3.self_attn.attn"].kv_cache is \
        attn["model.layers.1.self_attn.attn"].kv_cache
