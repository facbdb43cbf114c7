"""Gemma 4's "proportional" RoPE (`get_rope(rope_type="proportional")`) against transformers'
`_compute_proportional_rope_parameters`: the same frequencies (zero past the rotated share of
the head), so the same rotation of q / k."""

import pytest
import torch
from transformers import Gemma4TextConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from minivllm.model_executor.layers.rotary_embedding import Gemma4RotaryEmbedding, get_rope
from tests.model_executor.layers._helpers import layer_context


@pytest.mark.parametrize("factor", [0.25, 1.0])
def test_proportional_rope_matches_transformers(factor):
    head_dim, theta = 32, 1_000_000.0
    params = {"rope_type": "proportional", "partial_rotary_factor": factor, "rope_theta": theta}
    config = Gemma4TextConfig(num_hidden_layers=1, layer_types=["full_attention"], head_dim=16,
                              global_head_dim=head_dim, hidden_size=64, num_attention_heads=4,
                              rope_parameters={"full_attention": params,
                                               "sliding_attention": {"rope_type": "default",
                                                                     "rope_theta": 1e4}})
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu",
                                                          layer_type="full_attention")
    with layer_context():
        rope = get_rope(head_dim, max_position=64, rope_parameters=params, is_neox_style=True)
    assert isinstance(rope, Gemma4RotaryEmbedding) and rope.rotary_dim == head_dim
    torch.testing.assert_close(rope._compute_inv_freq(theta), hf_inv_freq.float())
    assert int((hf_inv_freq == 0).sum()) == head_dim // 2 - int(factor * head_dim) // 2
    # Rotating q: transformers' rotate_half form with cos/sin of the full head.
    positions = torch.arange(7)
    q = torch.randn(7, 2 * head_dim, generator=torch.Generator().manual_seed(0))
    got, _ = rope(positions, q.clone(), q.clone())
    angles = positions[:, None].float() * hf_inv_freq[None].float()
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    heads = q.view(7, 2, head_dim)
    rotated = torch.cat([-heads[..., head_dim // 2:], heads[..., :head_dim // 2]], -1)
    expected = heads * cos[:, None] + rotated * sin[:, None]
    torch.testing.assert_close(got.view(7, 2, head_dim), expected, atol=1e-5, rtol=1e-5)
