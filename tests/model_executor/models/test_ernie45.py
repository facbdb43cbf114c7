"""ERNIE 4.5 dense (interleaved-pair RoPE, `use_bias` on every projection, tied LM head)
against transformers."""

import pytest
import torch
from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         make_prompts, write_tiny_checkpoint)
from tests.model_executor.models.test_ernie45_moe import randomize

ARCH = "Ernie4_5ForCausalLM"
# Biased projections (zero at init, randomised below) and a tied head, as ERNIE-4.5-0.3B's.
TINY = dict(head_dim=16, use_bias=True, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def ernie45_path(tmp_path_factory) -> str:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ernie45"), Ernie4_5Config,
                                 Ernie4_5ForCausalLM, **TINY)
    randomize(path, ".bias", 0.1)
    return path


def test_ernie45_matches_transformers(ernie45_path):
    assert_matches_transformers(ernie45_path, prompts=make_prompts(1000, lens=(9, 33)),
                                num_tokens=16)


def test_ernie45_rope_style_and_biases(ernie45_path):
    model = build_model(ernie45_path)
    assert type(model).__module__ == "minivllm.model_executor.models.ernie45"
    layer = model.model.layers[0]
    assert layer.self_attn.rotary_emb.is_neox_style is False      # interleaved pairs
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert proj.bias is not None and bool(proj.bias.abs().sum() > 0)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_ernie45_prefixes_and_bad_names(ernie45_path, tmp_path):
    assert_prefixes_clean(ernie45_path, ARCH)
    assert_bad_names_reported(
        ernie45_path, tmp_path / "broken",
        drop=["model.layers.0.self_attn.o_proj.bias", "model.layers.1.mlp.down_proj.bias"])
