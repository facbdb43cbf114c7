"""Native bf16 RoPE (csrc/rotary_embedding.cpp): in place, bit-identical to forward_native."""

import pytest
import torch

from minivllm.config import VllmConfig, set_current_vllm_config
from minivllm.model_executor.kernels.rotary_embedding import rotary_embedding_bf16
from minivllm.model_executor.layers.rotary_embedding import get_rope

pytestmark = pytest.mark.requires_native


def _rope(is_neox: bool, partial: float, head_size: int = 64):
    with set_current_vllm_config(VllmConfig()):
        return get_rope(head_size, max_position=512, is_neox_style=is_neox,
                        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": partial})


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_bit_identical_to_forward_native_in_place(is_neox, partial, num_tokens):
    rope = _rope(is_neox, partial)
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, 9 * 64 + 2 * 3 * 64, generator=gen).bfloat16()
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)     # strided views of one row
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    ref_q, ref_k = rope.forward_native(positions, q.clone(), k.clone())
    out_q, out_k = rope.forward_cpu(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


def test_query_only_and_declines():
    rope = _rope(True, 1.0)
    q = torch.randn(2, 128).bfloat16()
    positions = torch.tensor([0, 7])
    ref, _ = rope.forward_native(positions, q.clone())
    out, key = rope.forward_cpu(positions, q)
    assert key is None and torch.equal(out, ref)
    cache = rope._match_cos_sin_cache(q)
    assert not rotary_embedding_bf16(positions, q.float(), None, cache, 64, 64, True)   # fp32
    assert not rotary_embedding_bf16(positions.int(), q, None, cache, 64, 64, True)     # int32


def test_position_outside_the_cache_is_an_error():
    rope = _rope(True, 1.0)
    q = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="outside the cos/sin cache of 512"):
        rope.forward_cpu(torch.tensor([512]), q)
