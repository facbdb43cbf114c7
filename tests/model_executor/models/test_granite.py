"""Granite (embedding / attention / residual multipliers, logits scaling) against transformers."""

from transformers import GraniteConfig, GraniteForCausalLM

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         write_tiny_checkpoint)

# Multipliers far from 1, so that forgetting any one of them changes the tokens.
MULTIPLIERS = dict(embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.4,
                   logits_scaling=3.0)


def test_granite_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "granite", GraniteConfig, GraniteForCausalLM,
                                 tie_word_embeddings=True, attention_bias=True, **MULTIPLIERS)
    assert_matches_transformers(path)
    assert_prefixes_clean(path, "GraniteForCausalLM")
    model = build_model(path)
    assert model.model.layers[0].self_attn.attn.impl.scale == 0.05
    assert model.logits_processor.scale == 1 / 3.0
    assert_bad_names_reported(path, tmp_path / "broken",
                              drop=["model.layers.1.post_attention_layernorm.weight",
                                    "model.norm.weight"])


def test_granite_is_registered():
    cls, _ = ModelRegistry.resolve_model_cls(["GraniteForCausalLM"])
    assert cls.__module__ == "minivllm.model_executor.models.granite"
    assert ModelRegistry.is_pp_supported_model(["GraniteForCausalLM"])


def test_granite_swa_matches_transformers(tmp_path):
    """Granite SWA: a window-8 layer beside full ones, a learned sink per head (random here:
    transformers starts them at 0), per-layer RoPE bases and one position-free layer (base 0).
    The prompts run past the window."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM

    path = write_tiny_checkpoint(
        tmp_path / "granite_swa", GraniteSWAConfig, GraniteSWAForCausalLM, num_hidden_layers=4,
        sliding_window=8, layer_rope_theta=[10000.0, 500.0, 10000.0, 0.0],
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"], **MULTIPLIERS)
    weights = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in weights:
        if name.endswith(".sinks"):
            weights[name] = torch.randn(weights[name].shape, generator=gen)
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    assert_matches_transformers(path)
    assert_prefixes_clean(path, "GraniteForCausalLM")
    layers = build_model(path).model.layers
    assert layers[3].self_attn.rotary_emb is None                  # theta 0: no RoPE
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, 8, 8, None]
    assert torch.equal(layers[1].self_attn.sinks, weights["model.layers.1.self_attn.sinks"])
