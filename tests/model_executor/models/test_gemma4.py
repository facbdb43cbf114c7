"""minivllm's own Gemma 4 (text) against transformers: sliding / full layers (window 8 < prompts)
with their own head sizes and KV heads, V = K on full layers, proportional partial RoPE, q / k /
v norms, KV-sharing last layers, final logit soft cap; a second checkpoint adds per-layer input
embeddings, MoE beside the MLP and double-wide MLPs on the sharing layers. Whole prompts and
chunks of 8; prefixes, bad names, registry, TP=2 (slow)."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from minivllm.model_executor.models.registry import ModelRegistry
from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                          assert_matches_transformers,
                                                          assert_prefixes_clean, build_model,
                                                          make_prompts, write_tiny_checkpoint)

# 6 layers: 0-3 own their caches, 4 (sliding) reads layer 3's, 5 (full) reads layer 2's.
DENSE = dict(num_hidden_layers=6, sliding_window=8, head_dim=16, global_head_dim=32,
             num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
             layer_types=["sliding_attention", "sliding_attention", "full_attention",
                          "sliding_attention", "sliding_attention", "full_attention"],
             hidden_size_per_layer_input=0, final_logit_softcapping=5.0, rms_norm_eps=1e-6)
# 4 layers, full layers with the global KV heads (no V = K), per-layer inputs, MoE, tied head.
EXTRAS = dict(num_hidden_layers=4, sliding_window=8, head_dim=16, global_head_dim=32,
              layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=1000,
              enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
              use_double_wide_mlp=True, final_logit_softcapping=30.0, tie_word_embeddings=True,
              rms_norm_eps=1e-6)
# Shorter than the family default: transformers' reference recomputes every step.
PROMPTS = make_prompts(1000, (5, 17, 33))
NUM_TOKENS = 16


def _write(folder, overrides: dict, shared_layers: range) -> str:
    """The tiny checkpoint with its scales moved off 1 (transformers starts `layer_scalar`, the
    router's `scale` and `per_expert_scale` at 1, where a weight not loaded would not show) and
    the k / v tensors original checkpoints still ship for the KV-sharing layers (transformers
    ignores them; minivllm must drop them)."""
    path = write_tiny_checkpoint(folder, Gemma4TextConfig, Gemma4ForCausalLM, **overrides)
    file = os.path.join(path, "model.safetensors")
    state, gen = load_file(file), torch.Generator().manual_seed(3)
    for name, tensor in state.items():
        if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
            state[name] = tensor * (0.5 + torch.rand(tensor.shape, generator=gen))
    for i in shared_layers:
        for name, shape in (("k_proj.weight", (32, 64)), ("v_proj.weight", (32, 64)),
                            ("k_norm.weight", (16,))):
            state[f"model.layers.{i}.self_attn.{name}"] = torch.randn(shape, generator=gen)
    save_file(state, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("gemma4_dense"), DENSE, range(4, 6))


@pytest.fixture(scope="module")
def extras_path(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("gemma4_extras"), EXTRAS, range(2, 4))


@pytest.mark.parametrize("budget", [512, 8])
def test_gemma4_dense_matches_transformers(dense_path, budget):
    assert_matches_transformers(dense_path, prompts=PROMPTS, num_tokens=NUM_TOKENS,
                                max_num_batched_tokens=budget)


@pytest.mark.parametrize("budget", [512, 8])
def test_gemma4_extras_match_transformers(extras_path, budget):
    assert_matches_transformers(extras_path, prompts=PROMPTS, num_tokens=NUM_TOKENS,
                                max_num_batched_tokens=budget)


def test_gemma4_layers_follow_the_config(dense_path, extras_path):
    layers = build_model(dense_path).model.layers
    attns = [layer.self_attn for layer in layers]
    assert [a.attn.sliding_window for a in attns] == [8, 8, None, 8, 8, None]
    assert [a.head_dim for a in attns] == [16, 16, 32, 16, 16, 32]
    assert [a.num_kv_heads for a in attns] == [2, 2, 1, 2, 2, 1]
    assert [a.attn.kv_sharing_target_layer_name for a in attns[4:]] == \
        ["model.layers.3.self_attn.attn", "model.layers.2.self_attn.attn"]
    assert all(a.attn.scale == 1.0 for a in attns)
    model = build_model(extras_path)
    assert model.logits_processor.soft_cap == 30.0
    assert model.num_moe_layers == 4 and model.num_logical_experts == 4
    # Double-wide MLPs on the two sharing layers: gate and up rows [2 * 2 * I, H].
    assert [layer.mlp.gate_up_proj.weight.shape[0] for layer in model.model.layers] == \
        [256, 256, 512, 512]


def test_gemma4_prefixes_and_bad_names(dense_path, extras_path, tmp_path):
    assert_prefixes_clean(dense_path, "Gemma4ForCausalLM")
    assert_prefixes_clean(extras_path, "Gemma4ForCausalLM")
    assert_bad_names_reported(extras_path, tmp_path / "broken",
                              drop=["model.layers.0.self_attn.k_norm.weight",
                                    "model.layers.1.router.per_expert_scale",
                                    "model.embed_tokens_per_layer.weight"])


def test_gemma4_registered_as_minivllms_own():
    cls = ModelRegistry.resolve_model_cls(["Gemma4ForCausalLM"])[0]
    assert cls.__module__ == "minivllm.model_executor.models.gemma4"


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "extras"])
def test_gemma4_tp2_matches_one_process(dense_path, extras_path, which):
    path = dense_path if which == "dense" else extras_path
    assert_parallel_matches_one_process(path, tensor_parallel_size=2)


@pytest.mark.slow
def test_gemma4_pp2_carries_per_layer_inputs(tmp_path):
    """Per-layer inputs built on the first stage reach the second one's layers. No KV sharing:
    a sharing layer must sit on its target's stage (the runner refuses otherwise)."""
    path = _write(tmp_path, {**EXTRAS, "num_kv_shared_layers": 0}, range(0))
    assert_parallel_matches_one_process(path, pipeline_parallel_size=2)
