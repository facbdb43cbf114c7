"""PhiMoE (Phi-3.5-MoE: LayerNorm blocks, biased attention and LM head, sparsemixer top-2
routing, LongRoPE with explicit mscales) against transformers' PhimoeForCausalLM."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PhimoeConfig, PhimoeForCausalLM
from transformers.models.phimoe.modeling_phimoe import sparsemixer

from minivllm.model_executor.models.interfaces import supports_lora, supports_pp
from minivllm.model_executor.models.phimoe import sparsemixer_routing
from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, make_prompts,
                                                         write_tiny_checkpoint)

TINY_PHIMOE = dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                   attention_bias=True, lm_head_bias=True)
ORIGINAL_MAX = 64


def write_phimoe_checkpoint(folder, seed: int = 0, arch: str | None = None, **overrides) -> str:
    """A tiny random PhiMoE checkpoint whose attention and LM-head biases are random too
    (transformers starts them at zero, where a dropped bias would not show); `arch` replaces
    config.json's architecture name (transformers writes `PhimoeForCausalLM`)."""
    path = write_tiny_checkpoint(folder, PhimoeConfig, PhimoeForCausalLM, seed=seed,
                                 **{**TINY_PHIMOE, **overrides})
    weights_file = os.path.join(path, "model.safetensors")
    state = load_file(weights_file)
    gen = torch.Generator().manual_seed(seed + 7)
    for name, tensor in state.items():
        if name.endswith(".bias") and "norm" not in name:
            state[name] = 0.3 * torch.randn(tensor.shape, generator=gen)
    save_file(state, weights_file, metadata={"format": "pt"})
    if arch is not None:
        _edit_config(path, lambda config: config.update(architectures=[arch]))
    return path


def _edit_config(path: str, edit) -> None:
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    edit(config)
    with open(config_file, "w") as f:
        json.dump(config, f)


def _longrope(rotary_half: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": ORIGINAL_MAX, "short_mscale": 1.1,
            "long_mscale": 1.35,
            "short_factor": (1 + torch.rand(rotary_half, generator=gen)).tolist(),
            "long_factor": (2 + 4 * torch.rand(rotary_half, generator=gen)).tolist()}


@pytest.fixture(scope="module")
def phimoe_path(tmp_path_factory) -> str:
    return write_phimoe_checkpoint(tmp_path_factory.mktemp("phimoe"))


@pytest.fixture(scope="module")
def longrope_path(tmp_path_factory) -> str:
    # head_dim 16: 8 rotated frequencies, one short and one long factor each.
    return write_phimoe_checkpoint(tmp_path_factory.mktemp("phimoe_longrope"), seed=1,
                                   max_position_embeddings=256, rope_parameters=_longrope(8))


def test_phimoe_matches_transformers(phimoe_path, tmp_path):
    assert_matches_transformers(phimoe_path, prompts=make_prompts(1000, lens=(5, 17, 40)),
                                num_tokens=16)
    assert_prefixes_clean(phimoe_path, "PhiMoEForCausalLM")
    assert_bad_names_reported(
        phimoe_path, tmp_path / "broken",
        drop=["model.layers.1.block_sparse_moe.experts.2.w3.weight",
              "model.layers.0.input_layernorm.bias", "lm_head.bias"],
        missing=["model.layers.1.mlp.experts.w13_weight", "model.layers.0.input_layernorm.bias",
                 "lm_head.bias"])


@pytest.mark.slow
def test_phimoe_wide_jitter_eps_matches_transformers(tmp_path):
    """router_jitter_noise 0.5: many experts stay in each pick's softmax (at 0.01 most weights
    are ~1), so a wrong mask or threshold shows in the logprobs."""
    path = write_phimoe_checkpoint(tmp_path, seed=2, router_jitter_noise=0.5)
    assert_matches_transformers(path, prompts=make_prompts(1000, lens=(9, 30)), num_tokens=12)


def test_sparsemixer_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=gen)
    logits[:8] -= 5.0                         # all-negative rows: the clamp(min=best) branch
    logits[8:16, 3] = logits[8:16, 5]         # ties between the best two
    for eps in (0.01, 0.3):
        weights, ids = sparsemixer_routing(logits, logits, 2, False, jitter_eps=eps)
        ref_weights, ref_ids = sparsemixer(logits, jitter_eps=eps, training=False)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-7)
    # Each weight is one softmax's share (not renormalised together); two distinct experts.
    assert ((weights > 0) & (weights <= 1)).all() and (ids[:, 0] != ids[:, 1]).all()
    with pytest.raises(ValueError, match="exactly 2 experts"):
        sparsemixer_routing(logits, logits, 3, False)


def test_phimoe_longrope_short_factors(longrope_path):
    """max_model_len within the original context: short factors and short_mscale, as
    transformers uses for sequences up to 64 tokens (these reach 57)."""
    assert_matches_transformers(longrope_path, prompts=make_prompts(1000, lens=(5, 33)),
                                max_model_len=ORIGINAL_MAX)


def test_phimoe_longrope_long_factors_across_the_original_context(longrope_path, tmp_path):
    """An engine whose max_model_len passes the original context rotates every position with the
    long factors and long_mscale (vLLM's one choice per engine); here a 56-token prompt crosses
    position 64 while generating, a 90-token one starts past it.

    Compared in vLLM's convention: transformers 5.25's PhimoeRotaryEmbedding always takes the
    short factors (it calls the LongRoPE init without a sequence length) and switches only the
    mscale, per forward call, at the original context. Its reference checkpoint therefore
    carries the long factors and long_mscale in the short slots, so it rotates as the engine does
    at every length."""
    reference = str(tmp_path / "reference")
    shutil.copytree(longrope_path, reference)

    def long_everywhere(config: dict) -> None:
        rope = config["rope_parameters"]
        rope.update(short_factor=rope["long_factor"], short_mscale=rope["long_mscale"])
    _edit_config(reference, long_everywhere)
    assert_matches_transformers(longrope_path, prompts=make_prompts(1000, lens=(56, 90)),
                                num_tokens=12, reference=reference)


def test_phimoe_is_registered():
    for arch in ("PhiMoEForCausalLM", "PhimoeForCausalLM"):
        cls, _ = ModelRegistry.resolve_model_cls([arch])
        assert cls.__name__ == "PhiMoEForCausalLM"
    assert cls.packed_modules_mapping == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert ModelRegistry.is_pp_supported_model(["PhiMoEForCausalLM"])
    assert supports_lora(cls) and supports_pp(cls)


@pytest.mark.slow
def test_phimoe_tp2_matches_transformers(phimoe_path):
    """Real gloo workers: each rank holds half of every expert, of the heads and of the vocab
    (the LM-head bias is sharded with it)."""
    assert_matches_transformers(phimoe_path, prompts=make_prompts(1000, lens=(5, 33)),
                                tensor_parallel_size=2)
