"""`MRotaryEmbedding` (multimodal RoPE) as `get_rope` builds it for Qwen2-VL (sectioned) and
Qwen3-VL (interleaved): [3, T] positions rotate as transformers' Qwen2-VL / Qwen3-VL rotary
modules define it; 1-D text positions rotate exactly as plain RoPE (also the bf16 kernel)."""

import pytest
import torch
from transformers import Qwen2VLTextConfig, Qwen3VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from minivllm.model_executor.layers.rotary_embedding import (MRotaryEmbedding, RotaryEmbedding,
                                                             get_rope)
from tests.model_executor.layers._helpers import layer_context

HEAD, N_HEADS, N_KV, MAX_POS, T = 16, 4, 2, 128, 12
THETA = 10000.0
# Unequal sections: a section split off by one frequency changes the result.
CASES = {"sectioned": ([2, 3, 3], False), "interleaved": ([4, 2, 2], True)}


@pytest.fixture(autouse=True)
def ctx():
    with layer_context() as config:
        yield config


def _mrope(section: list[int], interleaved: bool) -> MRotaryEmbedding:
    params = {"rope_type": "default", "rope_theta": THETA, "mrope_section": section}
    if interleaved:
        params["mrope_interleaved"] = True
    rope = get_rope(HEAD, MAX_POS, rope_parameters=params, dtype=torch.float32)
    assert isinstance(rope, MRotaryEmbedding)
    return rope


def _hf_rotate(section: list[int], interleaved: bool, positions: torch.Tensor,
               x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen2-VL / Qwen3-VL text rotary module (cos / sin recomposed per T / H / W
    section) applied in its rotate_half form; positions [3, T], x [T, heads * d]."""
    params = {"rope_type": "default", "rope_theta": THETA, "mrope_section": section}
    if interleaved:
        config = Qwen3VLTextConfig(hidden_size=64, num_attention_heads=N_HEADS, head_dim=HEAD,
                                   max_position_embeddings=MAX_POS,
                                   rope_parameters={**params, "mrope_interleaved": True})
        module = Qwen3VLTextRotaryEmbedding(config)
    else:
        config = Qwen2VLTextConfig(hidden_size=N_HEADS * HEAD, num_attention_heads=N_HEADS,
                                   max_position_embeddings=MAX_POS, rope_parameters=params)
        module = Qwen2VLRotaryEmbedding(config)
    cos, sin = module(x, positions[:, None, :])               # [1, T, d] each
    xh = x.view(T, -1, HEAD)                                   # [T, heads, d]
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]
    rotated_half = torch.cat([-xh[..., HEAD // 2:], xh[..., :HEAD // 2]], dim=-1)
    return (xh * cos + rotated_half * sin).reshape(T, -1)


@pytest.mark.parametrize("case", list(CASES))
def test_3d_positions_match_transformers(case):
    section, interleaved = CASES[case]
    rope = _mrope(section, interleaved)
    torch.manual_seed(0)
    positions = torch.randint(0, MAX_POS, (3, T))            # distinct T / H / W rows
    q, k = torch.randn(T, N_HEADS * HEAD), torch.randn(T, N_KV * HEAD)
    q_out, k_out = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(q_out, _hf_rotate(section, interleaved, positions, q))
    torch.testing.assert_close(k_out, _hf_rotate(section, interleaved, positions, k))
    # The comparison sees the sections: one H frequency read from T instead does not match.
    moved = [section[0] + 1, section[1] - 1, section[2]]
    assert not torch.allclose(q_out, _hf_rotate(moved, interleaved, positions, q), atol=1e-3)
    assert not torch.allclose(q_out, _hf_rotate(section, not interleaved, positions, q),
                              atol=1e-3)


@pytest.mark.parametrize("case", list(CASES))
def test_text_positions_rotate_as_plain_rope(case):
    """1-D positions (minivllm's runner) and [3, T] with equal rows equal plain RoPE; rows that
    differ do not, so the equality is about the positions, not a rotation ignoring them."""
    rope = _mrope(*CASES[case])
    plain = RotaryEmbedding(HEAD, HEAD, MAX_POS, THETA, True, torch.float32)
    torch.manual_seed(1)
    positions = torch.randint(0, MAX_POS - 2, (T,))
    q, k = torch.randn(T, N_HEADS * HEAD), torch.randn(T, N_KV * HEAD)
    ref_q, ref_k = plain(positions, q.clone(), k.clone())
    for pos in (positions, positions.expand(3, T)):
        q_out, k_out = rope(pos, q.clone(), k.clone())
        torch.testing.assert_close(q_out, ref_q, rtol=0, atol=1e-6)
        torch.testing.assert_close(k_out, ref_k, rtol=0, atol=1e-6)
    shifted = torch.stack([positions, positions + 1, positions + 2])
    assert not torch.allclose(rope(shifted, q.clone(), k.clone())[0], ref_q, atol=1e-3)


def test_bf16_text_positions_take_the_plain_kernel_path():
    """bf16 q / k with 1-D positions rotate bit-identically to the plain module (same path)."""
    params = {"rope_type": "default", "rope_theta": THETA, "mrope_section": [2, 3, 3]}
    rope = get_rope(HEAD, MAX_POS, rope_parameters=params, dtype=torch.bfloat16)
    plain = get_rope(HEAD, MAX_POS, rope_parameters={"rope_type": "default",
                                                     "rope_theta": THETA},
                     dtype=torch.bfloat16)
    assert isinstance(rope, MRotaryEmbedding) and plain is not rope
    torch.manual_seed(2)
    positions = torch.randint(0, MAX_POS, (T,))
    qkv = torch.randn(T, (N_HEADS + 2 * N_KV) * HEAD, dtype=torch.bfloat16)
    outs = []
    for module in (rope, plain):
        q, k, _ = qkv.clone().split([N_HEADS * HEAD, N_KV * HEAD, N_KV * HEAD], dim=-1)
        outs.append(module.forward_cpu(positions, q, k))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
