"""The native batched LoRA (bf16): equal to the grouped torch path within one bf16 rounding of
the output, for mixed slots, base tokens, padded ranks and packed slices."""

import pytest
import torch

from minivllm import _custom_ops as ops
from minivllm.lora.punica_wrapper import PunicaWrapper

pytestmark = pytest.mark.requires_native


def _tables(gen, loras, sizes, rank, real_rank, d_in):
    a = torch.zeros(loras, len(sizes) * rank, d_in)
    b = torch.zeros(loras, len(sizes) * rank, sum(sizes))
    for k, size in enumerate(sizes):
        a[:, k * rank:k * rank + real_rank] = torch.randn(loras, real_rank, d_in, generator=gen)
        b[:, k * rank:k * rank + real_rank, sum(sizes[:k]):sum(sizes[:k]) + size] = \
            torch.randn(loras, real_rank, size, generator=gen) * 0.1
    return a.bfloat16(), b.bfloat16()


@pytest.mark.parametrize("d_in", [96, 72])     # the bf16 dot-product path (32 | d) and the rest
@pytest.mark.parametrize("slots", [[0, 2, -1, 1, 2, 0, -1, 3], [1], [-1, 3, 3],
                                   [-1, 1, 1, 1, 1, 1, 1, 2, 2]])   # runs: groups of 4 + 2
def test_native_equals_reference(slots, d_in):
    assert ops.native_available()
    gen = torch.Generator().manual_seed(0)
    sizes, rank = [40, 8, 8], 8
    a, b = _tables(gen, 4, sizes, rank, 5, d_in)
    x = torch.randn(len(slots), d_in, generator=gen).bfloat16()
    out = torch.randn(len(slots), sum(sizes), generator=gen).bfloat16()
    slices = torch.tensor([[sum(sizes[:k]), s] for k, s in enumerate(sizes)])
    punica = PunicaWrapper(4, torch.bfloat16)
    punica.update(torch.tensor(slots))
    # fp64 reference of out + B A x per token
    want = out.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want[t] += b[s].double().T @ (a[s].double() @ x[t].double())
    got = out.clone()
    punica.add_lora_linear(got, x, a, b, slices)
    assert not torch.equal(got, out) or all(s < 0 for s in slots)
    # one rounding of the bf16 output: half an ulp, 2^-8 relative
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6)
    assert torch.equal(got[torch.tensor(slots) < 0], out[torch.tensor(slots) < 0])


def test_slot_outside_table_is_an_error():
    punica = PunicaWrapper(8, torch.bfloat16)
    punica.update(torch.tensor([5]))
    a, b = torch.zeros(2, 4, 8).bfloat16(), torch.zeros(2, 4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="outside the table"):
        punica.add_lora_linear(torch.zeros(1, 8).bfloat16(), torch.zeros(1, 8).bfloat16(), a, b,
                               torch.tensor([[0, 8]]))
