"""get_rope: one shared module per key, and numerics equal to transformers' Llama RoPE."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from minivllm.model_executor.layers.rotary_embedding import (LinearScalingRotaryEmbedding,
                                                             MRotaryEmbedding, RotaryEmbedding,
                                                             YaRNScalingRotaryEmbedding, get_rope)
from tests.model_executor.layers._helpers import layer_context

N_HEADS, N_KV, MAX_POS = 4, 2, 256


@pytest.fixture(autouse=True)
def ctx():
    with layer_context() as config:
        yield config


def hf_rotate(rope_params: dict, rotary_dim: int, positions, q, k, head_dim: int,
              inv_freq: torch.Tensor | None = None):
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb on the first rotary_dim features."""
    config = LlamaConfig(hidden_size=N_HEADS * rotary_dim, num_attention_heads=N_HEADS,
                         num_key_value_heads=N_KV, head_dim=rotary_dim,
                         max_position_embeddings=MAX_POS, rope_parameters=dict(rope_params))
    rope = LlamaRotaryEmbedding(config)
    if inv_freq is not None:  # dynamic NTK: evaluate the formula at a fixed length, no regrowth
        rope.inv_freq, rope.rope_type = inv_freq, "default"
    cos, sin = rope(q, positions[None])  # [1, T, rotary_dim]
    T = positions.shape[0]
    qh = q.view(1, T, N_HEADS, head_dim).transpose(1, 2)  # [1, nH, T, d]
    kh = k.view(1, T, N_KV, head_dim).transpose(1, 2)
    q_rot, k_rot = apply_rotary_pos_emb(qh[..., :rotary_dim], kh[..., :rotary_dim], cos, sin)
    q_out = torch.cat([q_rot, qh[..., rotary_dim:]], -1).transpose(1, 2).reshape(T, -1)
    k_out = torch.cat([k_rot, kh[..., rotary_dim:]], -1).transpose(1, 2).reshape(T, -1)
    return q_out, k_out


def _inputs(head_dim: int, num_tokens: int = 40):
    positions = torch.cat([torch.randint(0, MAX_POS, (num_tokens - 1,)), torch.tensor([MAX_POS - 1])])
    return (positions, torch.randn(num_tokens, N_HEADS * head_dim),
            torch.randn(num_tokens, N_KV * head_dim))


CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 16, 16),
    "default_1e6_d32": ({"rope_type": "default", "rope_theta": 1e6}, 32, 32),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 16, 16),
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, 32, 32),
    "yarn": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 64}, 16, 16),
    "yarn_mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 64, "mscale": 0.707,
                     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}, 16, 16),
    "yarn_attention_factor": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64,
                               "attention_factor": 1.3, "truncate": False}, 16, 16),
}


@pytest.mark.parametrize("name", CASES)
def test_rope_matches_transformers(name):
    params, head_dim, rotary_dim = CASES[name]
    positions, q, k = _inputs(head_dim)
    rope = get_rope(head_dim, MAX_POS, is_neox_style=True, rope_parameters=params)
    q_out, k_out = rope(positions, q.clone(), k.clone())
    q_ref, k_ref = hf_rotate(params, rotary_dim, positions, q, k, head_dim)
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, k_ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "rope_dim": 8}])
def test_partial_rotary_matches_transformers(params):
    head_dim, rotary_dim = 16, 8
    positions, q, k = _inputs(head_dim)
    rope = get_rope(head_dim, MAX_POS, rope_parameters=params)
    assert rope.rotary_dim == rotary_dim and rope.cos_sin_cache.shape[1] == rotary_dim
    hf_params = {k: v for k, v in params.items() if k not in ("partial_rotary_factor", "rope_dim")}
    q_ref, k_ref = hf_rotate(hf_params, rotary_dim, positions, q, k, head_dim)
    q_out, k_out = rope(positions, q, k)
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, k_ref, atol=1e-6, rtol=1e-6)


def test_dynamic_ntk_matches_transformers_at_max_position():
    head_dim, trained = 16, 128
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0,
              "max_trained_positions": trained}
    positions, q, k = _inputs(head_dim)
    rope = get_rope(head_dim, MAX_POS, rope_parameters=params)
    assert rope.cos_sin_cache.shape == (MAX_POS, head_dim)
    hf_config = LlamaConfig(hidden_size=N_HEADS * head_dim, num_attention_heads=N_HEADS,
                            head_dim=head_dim, max_position_embeddings=trained,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                             "factor": 2.0})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, seq_len=MAX_POS)
    q_ref, k_ref = hf_rotate({"rope_type": "default", "rope_theta": 10000.0}, head_dim,
                             positions, q, k, head_dim, inv_freq=inv_freq)
    q_out, k_out = rope(positions, q, k)
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, k_ref, atol=1e-6, rtol=1e-6)
    # Without max_trained_positions the 0.33 formula is a no-op.
    plain = get_rope(head_dim, MAX_POS, rope_parameters={"rope_type": "default"})
    no_op = get_rope(head_dim, MAX_POS, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    torch.testing.assert_close(no_op.cos_sin_cache, plain.cos_sin_cache)


def test_gptj_style_rotates_even_odd_pairs():
    rope = get_rope(8, MAX_POS, is_neox_style=False, rope_parameters={"rope_theta": 100.0})
    positions, q = torch.tensor([0, 3, 200]), torch.randn(3, 2 * 8)
    q_out, key = rope(positions, q)
    assert key is None
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8))
    angle = positions[:, None].float() * inv_freq  # [T, 4]
    x = q.view(3, 2, 4, 2)  # pairs (2i, 2i+1)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    expected = torch.stack([x[..., 0] * cos - x[..., 1] * sin,
                            x[..., 1] * cos + x[..., 0] * sin], -1).reshape(3, 16)
    torch.testing.assert_close(q_out, expected, atol=1e-6, rtol=1e-6)


def test_get_rope_caches_one_module_per_key():
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    first = get_rope(16, MAX_POS, rope_parameters=params)
    assert get_rope(16, MAX_POS, True, dict(reversed(list(params.items())))) is first
    assert get_rope(16, MAX_POS, rope_parameters=params, mrope_positions_factor=4) is first
    assert get_rope(16, MAX_POS, rope_parameters=params, dtype=torch.bfloat16) is not first
    assert get_rope(16, MAX_POS, is_neox_style=False, rope_parameters=params) is not first
    assert get_rope(16, MAX_POS) is get_rope(16, MAX_POS, rope_parameters=None)
    assert isinstance(get_rope(16, 64, rope_parameters={"rope_type": "yarn", "factor": 2.0}),
                      YaRNScalingRotaryEmbedding)
    assert "cos_sin_cache" not in first.state_dict()
    assert first.cos_sin_cache.dtype == torch.float32


def test_rope_errors():
    with pytest.raises(ValueError, match="Unknown RoPE scaling type 'nope'.*default, linear"):
        get_rope(16, MAX_POS, rope_parameters={"rope_type": "nope"})
    with pytest.raises(ValueError, match=r"LongRoPE needs rope_parameters \['short_factor'\]"):
        get_rope(16, MAX_POS, rope_parameters={"rope_type": "su", "long_factor": [1.0] * 8})
    with pytest.raises(ValueError, match="partial_rotary_factor must be in"):
        get_rope(16, MAX_POS, rope_parameters={"partial_rotary_factor": 1.5})
    with pytest.raises(NotImplementedError, match="M-RoPE.*YaRN"):
        get_rope(16, MAX_POS, rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                               "mrope_section": [2, 3, 3]})
    with pytest.raises(NotImplementedError, match="use_fope"):
        get_rope(16, MAX_POS, rope_parameters={"use_fope": True})
    with pytest.raises(ValueError, match="mrope_section must hold 3 counts"):
        get_rope(16, MAX_POS, rope_parameters={"mrope_section": [2, 3, 2]})


def test_get_rope_builds_mrope_from_mrope_section():
    """As vLLM: the default type with `mrope_section` builds MRotaryEmbedding (interleaved when
    `mrope_interleaved`), one module per key; other scaled types ignore the section."""
    sectioned = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    rope = get_rope(16, MAX_POS, rope_parameters=sectioned)
    assert isinstance(rope, MRotaryEmbedding) and rope.mrope_section == [2, 3, 3]
    assert not rope.mrope_interleaved and rope.base == 1e6
    assert get_rope(16, MAX_POS, rope_parameters=dict(sectioned)) is rope
    interleaved = get_rope(16, MAX_POS, rope_parameters={**sectioned, "mrope_interleaved": True})
    assert interleaved is not rope and interleaved.mrope_interleaved
    plain = get_rope(16, MAX_POS, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert not isinstance(plain, MRotaryEmbedding)
    linear = get_rope(16, MAX_POS, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                    "mrope_section": [2, 3, 3]})
    assert type(linear) is LinearScalingRotaryEmbedding


def test_bf16_queries_use_a_cast_cache():
    rope = RotaryEmbedding(16, 16, MAX_POS, 10000.0, True, torch.float32)
    positions, q, k = _inputs(16, 5)
    q_ref, k_ref = rope(positions, q, k)
    q_bf, k_bf = rope(positions, q.bfloat16(), k.bfloat16())
    assert q_bf.dtype == torch.bfloat16 and rope.cos_sin_cache.dtype == torch.bfloat16
    torch.testing.assert_close(q_bf.float(), q_ref, atol=0.05, rtol=0.02)
    torch.testing.assert_close(k_bf.float(), k_ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("mscale, mscale_all_dim", [(1.0, 0.0), (0.707, 0.707), (1.0, 0.8)])
def test_deepseek_yarn_scales_by_the_mscale_ratio(mscale, mscale_all_dim):
    # vLLM's DeepSeek file renames YaRN to "deepseek_yarn": same frequencies, cos/sin scaled by
    # mscale(f, mscale) / mscale(f, mscale_all_dim) (defaults 1 and 0), nothing else.
    from minivllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale

    base = {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "rope_theta": 10000.0}
    ds = get_rope(16, 256, False, {**base, "rope_type": "deepseek_yarn", "mscale": mscale,
                                   "mscale_all_dim": mscale_all_dim})
    plain = get_rope(16, 256, False, {**base, "rope_type": "yarn", "attention_factor": 1.0})
    ratio = yarn_get_mscale(4.0, mscale) / yarn_get_mscale(4.0, mscale_all_dim)
    assert isinstance(ds, YaRNScalingRotaryEmbedding)
    torch.testing.assert_close(ds.cos_sin_cache, plain.cos_sin_cache * ratio)
