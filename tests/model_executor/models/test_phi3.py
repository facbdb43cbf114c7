"""Phi-3 (fused qkv / gate_up checkpoints, LongRoPE, partial rotary) against transformers."""

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from minivllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from minivllm.model_executor.layers.rotary_embedding import (Phi3LongRoPEScaledRotaryEmbedding,
                                                             get_rope)
from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, make_prompts,
                                                         write_tiny_checkpoint)

ORIGINAL_MAX = 64


def _longrope(rotary_half: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(rotary_half, generator=gen)).tolist(),
            "long_factor": (2 + 4 * torch.rand(rotary_half, generator=gen)).tolist()}


@pytest.fixture(scope="module")
def longrope_path(tmp_path_factory) -> str:
    # head_dim 16, partial_rotary_factor 0.5 (as Phi-4-mini): 8 rotated features, 4 factors each.
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("phi3_longrope"), Phi3Config, Phi3ForCausalLM,
        rms_norm_eps=1e-5, max_position_embeddings=256, pad_token_id=0,
        original_max_position_embeddings=ORIGINAL_MAX, partial_rotary_factor=0.5,
        rope_parameters=_longrope(4))


def test_phi3_fused_checkpoint_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "phi3", Phi3Config, Phi3ForCausalLM,
                                 tie_word_embeddings=True)
    assert_matches_transformers(path)
    assert_prefixes_clean(path, "Phi3ForCausalLM")
    assert_bad_names_reported(path, tmp_path / "broken",
                              drop=["model.layers.1.self_attn.qkv_proj.weight"])


def test_phi3_longrope_short_factors(longrope_path):
    """max_model_len within the original context: the short factors (sequences up to 57 tokens;
    past 64 transformers would switch to the long ones)."""
    assert_matches_transformers(longrope_path, prompts=make_prompts(1000, lens=(5, 17, 33)),
                                max_model_len=ORIGINAL_MAX)


def test_phi3_longrope_long_factors_past_the_original_context(longrope_path):
    """Prompts longer than the original context: transformers takes the long factors, as an
    engine whose max_model_len passes it does (the generated tokens cross position 100)."""
    prompts = make_prompts(1000, lens=(70, 90))
    assert_matches_transformers(longrope_path, prompts=prompts, num_tokens=16)


def test_longrope_table_choice_and_mscale():
    params = {**_longrope(8), "original_max_position_embeddings": ORIGINAL_MAX}
    hf_config = Phi3Config(max_position_embeddings=256,
                           original_max_position_embeddings=ORIGINAL_MAX)
    ropes = []
    for max_model_len in (ORIGINAL_MAX, None):            # None: the model's 256
        config = VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf_config,
                                                     max_model_len=max_model_len))
        with set_current_vllm_config(config):
            ropes.append(get_rope(16, 256, rope_parameters=params))
    short, long = ropes
    assert isinstance(short, Phi3LongRoPEScaledRotaryEmbedding) and short is not long
    assert not short.use_long_rope and long.use_long_rope
    assert short.cos_sin_cache.shape == (ORIGINAL_MAX, 16) and long.cos_sin_cache.shape == (256, 16)
    mscale = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(64.0))).sqrt()
    assert long.long_mscale == pytest.approx(mscale.item())
    inv_freq = 1 / (torch.tensor(params["long_factor"])
                    * 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(long.cos_sin_cache[5, :8], torch.cos(5 * inv_freq) * mscale)
    with pytest.raises(ValueError, match="long_factor must have rotary_dim / 2 = 8"):
        with set_current_vllm_config(config):
            get_rope(16, 256, rope_parameters={**params, "long_factor": [1.0] * 3})


def test_phi3_is_registered():
    cls, arch = ModelRegistry.resolve_model_cls(["Phi3ForCausalLM"])
    assert cls.__name__ == "Phi3ForCausalLM"
    assert cls.packed_modules_mapping["qkv_proj"] == ["qkv_proj"]
    assert ModelRegistry.is_pp_supported_model(["Phi3ForCausalLM"])
