"""Seed-OSS (q / k / v biases, o_proj bias off, explicit head_dim) against transformers."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import SeedOssConfig, SeedOssForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         write_tiny_checkpoint)

ARCH = "SeedOssForCausalLM"


def _randomise_biases(path: str) -> None:
    """transformers starts every bias at 0, where a bias loaded into the wrong slot would not
    show: give them values."""
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in state if n.endswith(".bias")]:
        state[name] = 0.3 * torch.randn(state[name].shape, generator=gen)
    save_file(state, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def seed_oss_path(tmp_path_factory) -> str:
    # head_dim 32 with 4 heads: q is 128 wide on a 64-wide hidden state. The released configs'
    # attention_bias=True / attention_out_bias=False are the defaults.
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("seed_oss"), SeedOssConfig,
                                 SeedOssForCausalLM, head_dim=32)
    _randomise_biases(path)
    return path


def test_seed_oss_matches_transformers(seed_oss_path, tmp_path):
    assert_matches_transformers(seed_oss_path)
    assert_prefixes_clean(seed_oss_path, ARCH)
    attn = build_model(seed_oss_path).model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert attn.qkv_proj.bias.shape == (128 + 2 * 2 * 32,)
    # Every missing and unexpected name in one error.
    biases = [f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkv"]
    assert_bad_names_reported(seed_oss_path, tmp_path / "broken",
                              drop=[*biases, "model.layers.0.mlp.down_proj.weight"],
                              missing=["model.layers.1.self_attn.qkv_proj.bias",
                                       "model.layers.0.mlp.down_proj.weight"])
