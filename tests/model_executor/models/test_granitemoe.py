"""Granite MoE and Granite MoE Shared (Granite's multipliers on sparse MoE blocks with fused
expert tensors; the shared variant adds a dense shared MLP) against transformers."""

import pytest
import torch
from transformers import (GraniteMoeConfig, GraniteMoeForCausalLM, GraniteMoeSharedConfig,
                          GraniteMoeSharedForCausalLM)

from minivllm.model_executor.layers.fused_moe import FusedMoE
from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         make_prompts, write_tiny_checkpoint)

# Multipliers far from 1, so that forgetting any one of them changes the tokens; 8 experts,
# top-2; the expert width differs from the shared MLP's so a swapped tensor fails to load.
TINY_GRANITE_MOE = dict(embedding_multiplier=6.0, attention_multiplier=0.05,
                        residual_multiplier=0.4, logits_scaling=3.0, num_local_experts=8,
                        num_experts_per_tok=2, intermediate_size=32)
ARCHS = {"GraniteMoeForCausalLM": "minivllm.model_executor.models.granitemoe:"
                                  "GraniteMoeForCausalLM",
         "GraniteMoeSharedForCausalLM": "minivllm.model_executor.models.granitemoe:"
                                        "GraniteMoeSharedForCausalLM"}
# Shorter runs than the family default (the suite's time budget); the 33-token prompt and the
# decodes still route every token through its own pair of experts.
PROMPTS = make_prompts(1000, (5, 17, 33))
NUM_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def registered():
    """minivllm's own classes for the two architectures (restoring the registry afterwards)."""
    saved = {arch: ModelRegistry.models.get(arch) for arch in ARCHS}
    for arch, spec in ARCHS.items():
        ModelRegistry.register_model(arch, spec)
    yield
    for arch, entry in saved.items():
        if entry is None:
            ModelRegistry.models.pop(arch, None)
        else:
            ModelRegistry.models[arch] = entry


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("granitemoe"), GraniteMoeConfig,
                                 GraniteMoeForCausalLM, **TINY_GRANITE_MOE)


@pytest.fixture(scope="module")
def shared_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("granitemoeshared"),
                                 GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM,
                                 num_hidden_layers=3, shared_intermediate_size=48,
                                 tie_word_embeddings=True, **TINY_GRANITE_MOE)


def test_granitemoe_matches_transformers(moe_path):
    assert_matches_transformers(moe_path, prompts=PROMPTS, num_tokens=NUM_TOKENS)


def test_granitemoeshared_matches_transformers(shared_path):
    assert_matches_transformers(shared_path, prompts=PROMPTS, num_tokens=NUM_TOKENS)


def test_granitemoe_layers_and_multipliers(moe_path, shared_path):
    model = build_model(moe_path)
    layer = model.model.layers[0]
    assert layer.shared_mlp is None and isinstance(layer.block_sparse_moe.experts, FusedMoE)
    assert layer.self_attn.attn.impl.scale == 0.05 and model.logits_processor.scale == 1 / 3.0
    # The fused input_linear [E, 2I, H] lands as w13 (gate rows, then up rows) per expert.
    from safetensors.torch import load_file
    ckpt = load_file(f"{moe_path}/model.safetensors")
    torch.testing.assert_close(layer.block_sparse_moe.experts.w13_weight,
                               ckpt["model.layers.0.block_sparse_moe.input_linear.weight"])
    shared = build_model(shared_path)
    assert [type(layer.shared_mlp).__name__ for layer in shared.model.layers] == \
        ["GraniteMoeSharedMLP"] * 3
    assert len(shared.get_expert_mapping()) == 3 * 8


def test_granitemoe_prefixes_and_bad_names(moe_path, shared_path, tmp_path):
    assert_prefixes_clean(moe_path, "GraniteMoeForCausalLM")
    assert_prefixes_clean(shared_path, "GraniteMoeSharedForCausalLM")
    assert_bad_names_reported(shared_path, tmp_path / "broken",
                              drop=["model.layers.1.block_sparse_moe.output_linear.weight",
                                    "model.layers.2.shared_mlp.input_linear.weight",
                                    "model.layers.0.block_sparse_moe.router.layer.weight"],
                              missing=["layers.1.block_sparse_moe.experts.w2_weight",
                                       "layers.2.shared_mlp.input_linear",
                                       "layers.0.block_sparse_moe.gate.weight"])


@pytest.mark.slow
def test_granitemoe_swa_runs_on_the_shared_class(tmp_path):
    """Granite MoE SWA (vLLM serves it with the shared class): window-8 layers, a random sink
    per head, per-layer RoPE bases and one position-free layer; its checkpoint uses the newer
    names (`experts.gate_up_proj` / `experts.down_proj` without `.weight`, `router.weight`)."""
    from safetensors.torch import load_file, save_file
    from transformers import GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM

    saved = ModelRegistry.models.get("GraniteMoeSWAForCausalLM")
    ModelRegistry.register_model("GraniteMoeSWAForCausalLM",
                                 ARCHS["GraniteMoeSharedForCausalLM"])
    try:
        path = write_tiny_checkpoint(
            tmp_path / "swa", GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM, num_hidden_layers=4,
            sliding_window=8, layer_rope_theta=[10000.0, 500.0, 10000.0, 0.0],
            layer_types=["full_attention", "sliding_attention", "sliding_attention",
                         "full_attention"], shared_intermediate_size=48, **TINY_GRANITE_MOE)
        weights = load_file(f"{path}/model.safetensors")
        assert "model.layers.1.block_sparse_moe.experts.gate_up_proj" in weights
        gen = torch.Generator().manual_seed(3)
        for name in weights:
            if name.endswith(".sinks"):
                weights[name] = torch.randn(weights[name].shape, generator=gen)
        save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
        assert_matches_transformers(path, prompts=PROMPTS, num_tokens=NUM_TOKENS)
        assert_prefixes_clean(path, "GraniteMoeSharedForCausalLM")
        layers = build_model(path).model.layers
        assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, 8, 8, None]
        assert layers[3].self_attn.rotary_emb is None
    finally:
        if saved is None:
            ModelRegistry.models.pop("GraniteMoeSWAForCausalLM", None)
        else:
            ModelRegistry.models["GraniteMoeSWAForCausalLM"] = saved


@pytest.mark.slow
def test_granitemoeshared_at_tp2_equals_one_process(shared_path):
    """TP=2 splits every expert's intermediate dimension and the shared MLP's."""
    from minivllm.entrypoints.check_model.build import model_file_plugin
    from minivllm.model_executor.models import granitemoe
    from tests._parallel_helpers import assert_parallel_matches_one_process

    # The worker processes register the class through a general plugin, as a user would.
    with model_file_plugin(f"{granitemoe.__file__}:GraniteMoeSharedForCausalLM",
                           "GraniteMoeSharedForCausalLM"):
        assert_parallel_matches_one_process(shared_path, tensor_parallel_size=2)
