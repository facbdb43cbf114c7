"""StableLM (LayerNorm blocks, partial rotary, q/k/v bias; parallel residual and per-head QK
LayerNorm as in StableLM 2 12B) against transformers."""

import pytest
from transformers import StableLmConfig, StableLmForCausalLM

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, make_prompts,
                                                         write_tiny_checkpoint)

BASE = dict(rms_norm_eps=None, layer_norm_eps=1e-5, partial_rotary_factor=0.25)


def test_stablelm_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "stablelm", StableLmConfig, StableLmForCausalLM,
                                 use_qkv_bias=True, **BASE)
    assert_matches_transformers(path)
    assert_prefixes_clean(path, "StablelmForCausalLM")
    assert_bad_names_reported(path, tmp_path / "broken",
                              drop=["model.norm.bias", "model.layers.1.input_layernorm.weight"])


@pytest.fixture(scope="module")
def parallel_qk_norm_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("stablelm_12b"), StableLmConfig,
                                 StableLmForCausalLM, use_parallel_residual=True,
                                 qk_layernorm=True, **BASE)


def test_stablelm_parallel_residual_and_qk_layernorm(parallel_qk_norm_path, tmp_path):
    assert_matches_transformers(parallel_qk_norm_path)
    assert_bad_names_reported(parallel_qk_norm_path, tmp_path / "broken",
                              drop=["model.layers.0.self_attn.k_layernorm.norms.1.weight"],
                              missing=["model.layers.0.self_attn.k_layernorm.weight"],
                              extra=("model.layers.0.self_attn.q_layernorm.scale",))


@pytest.mark.slow
def test_stablelm_qk_layernorm_tp2(parallel_qk_norm_path):
    """Each rank keeps the per-head norm weights of its own heads."""
    assert_matches_transformers(parallel_qk_norm_path, prompts=make_prompts(1000, lens=(9, 40)),
                                num_tokens=12, tensor_parallel_size=2)


def test_stablelm_is_registered():
    for arch in ("StableLmForCausalLM", "StableLMEpochForCausalLM"):
        cls, _ = ModelRegistry.resolve_model_cls([arch])
        assert cls.__name__ == "StablelmForCausalLM"
