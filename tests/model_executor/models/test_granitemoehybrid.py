"""Granite 4.0 hybrid (Mamba-2 layers beside attention layers, MoE + shared MLP or the shared
MLP alone, Granite's multipliers) against transformers: whole prompts, prompts in chunks (the
Mamba states carried between a sequence's steps), preemption (a recomputed sequence restarts its
states), TP=2."""

import pytest
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from minivllm import LLM
from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (TINY_DENSE, assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_preemption_keeps_tokens,
                                                         assert_prefixes_clean, build_model,
                                                         hf_greedy, make_prompts,
                                                         minivllm_greedy, write_checkpoints)
from tests.model_executor.models._family_helpers import STATE_BUDGETS

ARCH = "GraniteMoeHybridForCausalLM"
SPEC = "minivllm.model_executor.models.granitemoehybrid:GraniteMoeHybridForCausalLM"
# 8 Mamba heads of 16 over an inner width of 128, one SSM group; chunk_size 16 so transformers'
# own scan chunks too. Multipliers far from 1, so a dropped one changes the tokens.
TINY_HYBRID = dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
                   mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_n_groups=1,
                   mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
                   shared_intermediate_size=48, embedding_multiplier=6.0,
                   attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=3.0)
VARIANTS = {
    # Granite-4.0-H tiny / small's form: 4 experts top-2 plus the shared MLP, position-free
    # attention.
    "moe_nope": dict(TINY_HYBRID, num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=32, position_embedding_type=None),
    # No experts (the shared MLP alone) and RoPE on the attention layer (slow tests only).
    "dense_rope": dict(TINY_HYBRID, num_local_experts=0, position_embedding_type="rope"),
}
# Fewer and shorter runs than the family default: transformers' Mamba-2 scan runs its slow
# reference path, once per generated token. 17 and 33 tokens still span several 8-token chunks.
PROMPTS = make_prompts(TINY_DENSE["vocab_size"], (5, 17, 33))
NUM_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def registered():
    """minivllm's own class for the architecture (restoring the registry afterwards)."""
    saved = ModelRegistry.models.get(ARCH)
    ModelRegistry.register_model(ARCH, SPEC)
    yield
    if saved is None:
        ModelRegistry.models.pop(ARCH, None)
    else:
        ModelRegistry.models[ARCH] = saved


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return write_checkpoints(tmp_path_factory, "granitemoehybrid", GraniteMoeHybridConfig,
                             GraniteMoeHybridForCausalLM, VARIANTS)


@pytest.fixture(scope="module")
def hf_reference(paths) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and logprobs, computed once for both budgets."""
    return hf_greedy(paths["moe_nope"], PROMPTS, NUM_TOKENS)


@STATE_BUDGETS
def test_granitemoehybrid_matches_transformers(paths, hf_reference, budget):
    # 8 tokens per step: every prompt is prefilled in chunks beside other sequences' decodes,
    # the Mamba states carried from chunk to chunk.
    llm = LLM(model=paths["moe_nope"], dtype="float32", block_size=4,
              max_num_batched_tokens=budget)
    ours = minivllm_greedy(llm, PROMPTS, NUM_TOKENS)
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, hf_reference)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: logprobs differ by {diff:.3g}"


@pytest.mark.slow
def test_granitemoehybrid_dense_rope_matches_transformers(paths):
    assert_matches_transformers(paths["dense_rope"], prompts=PROMPTS, num_tokens=NUM_TOKENS)


def test_granitemoehybrid_layers_and_state_shapes(paths):
    from minivllm.model_executor.models.interfaces import needs_state_slots

    model = build_model(paths["moe_nope"])
    layers = model.model.layers
    assert [type(layer).__name__ for layer in layers] == [
        "GraniteMoeHybridMambaDecoderLayer", "GraniteMoeHybridAttentionDecoderLayer",
        "GraniteMoeHybridMambaDecoderLayer", "GraniteMoeHybridMambaDecoderLayer"]
    assert needs_state_slots(model) and model.is_hybrid and model.has_inner_state
    assert layers[1].self_attn.rotary_emb is None
    assert layers[1].self_attn.attn.impl.scale == 0.05
    # The class methods give the shapes / dtypes the mixers allocated (one row per slot).
    from minivllm.config import ModelConfig, VllmConfig
    mixer = layers[0].mamba
    config = VllmConfig(model_config=ModelConfig(model=paths["moe_nope"], dtype="float32"))
    shapes = type(model).get_mamba_state_shape_from_config(config)
    assert (tuple(mixer.conv_state.shape[1:]), tuple(mixer.ssm_state.shape[1:])) == shapes
    assert shapes == ((3, 128 + 2 * 16), (8, 16, 16))
    dtypes = type(model).get_mamba_state_dtype_from_config(config)
    assert (mixer.conv_state.dtype, mixer.ssm_state.dtype) == dtypes
    dense = build_model(paths["dense_rope"]).model.layers
    assert all(layer.block_sparse_moe is None for layer in dense)
    assert dense[1].self_attn.rotary_emb is not None


def test_granitemoehybrid_prefixes_and_bad_names(paths, tmp_path):
    assert_prefixes_clean(paths["moe_nope"], ARCH)
    assert_bad_names_reported(paths["moe_nope"], tmp_path / "broken",
                              drop=["model.layers.2.mamba.A_log",
                                    "model.layers.1.self_attn.k_proj.weight",
                                    "model.layers.3.block_sparse_moe.input_linear.weight"],
                              missing=["layers.2.mamba.A", "layers.1.self_attn.qkv_proj",
                                       "layers.3.block_sparse_moe.experts.w13_weight"])


def test_granitemoehybrid_rejects_unknown_layer_type(paths, tmp_path):
    import json
    import shutil

    broken = tmp_path / "bad_types"
    shutil.copytree(paths["dense_rope"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["layer_types"][2] = "conv"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer_types\\[2\\] must be one of"):
        build_model(str(broken))


@pytest.mark.slow
def test_granitemoehybrid_preempted_sequences_restart_their_state(paths):
    assert_preemption_keeps_tokens(paths["moe_nope"])


@pytest.mark.slow
def test_granitemoehybrid_at_tp2_equals_one_process(paths):
    """TP=2 splits the Mamba heads (the single SSM group copied to both ranks), the attention
    heads, every expert's intermediate dimension and the shared MLP."""
    from minivllm.entrypoints.check_model.build import model_file_plugin
    from minivllm.model_executor.models import granitemoehybrid
    from tests._parallel_helpers import assert_parallel_matches_one_process

    # The worker processes register the class through a general plugin, as a user would.
    with model_file_plugin(f"{granitemoehybrid.__file__}:{ARCH}", ARCH):
        assert_parallel_matches_one_process(paths["moe_nope"], tensor_parallel_size=2)
