"""`fused_qk_rmsnorm_rope_gate` (Qwen's gated attention input step) against the unfused steps:
split [q | gate] per head, Gemma-style RMSNorm of every head, partial NeoX RoPE; multimodal
[3, T] positions whose three rows agree rotate as the text positions do, and
`MRotaryEmbedding` agrees with the plain module on them."""

import pytest
import torch

from minivllm.model_executor.layers.fused_qk_norm_rope import fused_qk_rmsnorm_rope_gate
from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from minivllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
from tests.model_executor.layers._helpers import layer_context

HQ, HKV, D, ROT, T = 4, 2, 16, 8, 7


@pytest.fixture(autouse=True)
def _config():
    with layer_context() as config:
        yield config


def _reference(q_gate, k, wq, wk, cache, positions, eps):
    """The eager path of vLLM's qwen3_next.py, written out: (1 + w) norms, rotate_half RoPE."""
    q, gate = q_gate.view(T, HQ, 2 * D).chunk(2, dim=-1)

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    def rope(x):
        cos, sin = cache[positions].chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        rot, rest = x[..., :ROT], x[..., ROT:]
        half = torch.cat([-rot[..., ROT // 2:], rot[..., :ROT // 2]], -1)
        return torch.cat([rot * cos + half * sin, rest], -1)

    q = rope(norm(q, wq)).reshape(T, -1)
    k = rope(norm(k.view(T, HKV, D), wk)).reshape(T, -1)
    return q, k, gate.reshape(T, -1)


def _inputs():
    torch.manual_seed(0)
    rope = RotaryEmbedding(D, ROT, 64, 10000.0, True, torch.float32, init_cache=True)
    return (torch.randn(T, HQ * 2 * D), torch.randn(T, HKV * D), 0.3 * torch.randn(D),
            0.3 * torch.randn(D), rope.cos_sin_cache, torch.randint(0, 64, (T,)))


def test_matches_the_unfused_steps():
    q_gate, k, wq, wk, cache, positions = _inputs()
    got = fused_qk_rmsnorm_rope_gate(q_gate, k, wq, wk, cache, positions, 1e-6, HQ, HKV, D,
                                     ROT, norm_beta=1.0)
    for ours, ref in zip(got, _reference(q_gate, k, wq, wk, cache, positions, 1e-6)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_multimodal_positions_with_equal_rows_rotate_like_text():
    q_gate, k, wq, wk, cache, positions = _inputs()
    text = fused_qk_rmsnorm_rope_gate(q_gate, k, wq, wk, cache, positions, 1e-6, HQ, HKV, D,
                                      ROT)
    mm = fused_qk_rmsnorm_rope_gate(q_gate, k, wq, wk, cache, positions.expand(3, T), 1e-6,
                                    HQ, HKV, D, ROT, mrope_section=[2, 1, 1])
    for a, b in zip(text, mm):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="mrope_section"):
        fused_qk_rmsnorm_rope_gate(q_gate, k, wq, wk, cache, positions.expand(3, T), 1e-6,
                                   HQ, HKV, D, ROT, mrope_section=[1, 1, 1])


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrotary_embedding(interleaved):
    plain = RotaryEmbedding(D, ROT, 64, 10000.0, True, torch.float32)
    mrope = MRotaryEmbedding(D, ROT, 64, 10000.0, True, torch.float32, [2, 1, 1], interleaved)
    q, k, positions = torch.randn(T, HQ * D), torch.randn(T, HKV * D), torch.randint(0, 64, (T,))
    ref = plain.forward_native(positions, q.clone(), k.clone())
    for got in (mrope.forward_native(positions, q.clone(), k.clone()),
                mrope.forward_native(positions.expand(3, T), q.clone(), k.clone())):
        torch.testing.assert_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])
    # Distinct H / W rows change exactly the frequencies they own.
    pos3 = torch.stack([positions, positions + 1, positions + 2])
    q3, _ = mrope.forward_native(pos3, q.clone(), k.clone())
    assert not torch.allclose(q3, ref[0])
