"""The native MoE kernels (`csrc/fused_moe.cpp`): routing equals torch's `fused_topk`, and the
one-call experts equal the per-expert AMX GEMMs they are built from (bit for bit with one expert
per token; within one bf16 rounding of the fp32 top-k sum otherwise), for ragged groups, idle
experts, other ranks' experts (expert_map) and any thread count."""

import pytest
import torch

from minivllm import _custom_ops as ops
from minivllm.model_executor.layers.fused_moe.cpu_fused_moe import (experts_supported,
                                                                    fused_experts_bf16, moe_topk)

from tests.csrc._moe_helpers import E, H, I, expert_weights, fused_moe_py, routed_tokens

pytestmark = pytest.mark.requires_native



@pytest.fixture(scope="module", autouse=True)
def _amx():
    if not ops.native_available() or not ops._has_amx:
        pytest.skip("this CPU (or kernel) offers no AMX: the torch expert loop stays in use")


@pytest.fixture(scope="module")
def weights():
    return expert_weights(0)


def _routing(num_tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return routed_tokens(num_tokens, k, seed)


def _pair_outputs(x, w1, w2, ids) -> torch.Tensor:
    """[T, k, H] bf16: each (token, expert) pair through the per-expert AMX GEMMs."""
    out = torch.empty(*ids.shape, H, dtype=torch.bfloat16)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = ops.gemm_silu_mul_bf16(x[t:t + 1], w1[e], None)
            out[t, j] = ops.gemm_bf16(h, w2[e], None)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_matches_torch_routing(dtype, scoring, renormalize):
    logits = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    w, ids = moe_topk(logits, 6, renormalize, scoring, scale=2.5)
    ref_w, ref_ids, _ = fused_moe_py.fused_topk(torch.empty(37, 8), logits, 6, renormalize,
                                                scoring_func=scoring)
    torch.testing.assert_close(w, ref_w * 2.5, rtol=1e-6, atol=1e-7)
    chosen = logits.float().gather(1, ids)
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()                 # by descending score
    assert torch.equal(chosen, logits.float().gather(1, ref_ids))  # the same scores as torch
    if dtype == torch.float32:                                     # no ties: the same experts
        assert torch.equal(ids, ref_ids)
    else:   # bf16 logits tie (torch orders ties as it likes): ties go to the lower index here
        tie = chosen[:, :-1] == chosen[:, 1:]
        assert tie.any() and (ids[:, :-1][tie] < ids[:, 1:][tie]).all()


def test_topk_refuses_what_it_cannot_take():
    assert moe_topk(torch.randn(4, 8), 9, True, "softmax") is None           # k > E
    assert moe_topk(torch.randn(4, 8), 2, True, "softmax_v2") is None
    assert moe_topk(torch.randn(4, 8).half(), 2, True, "softmax") is None


@pytest.mark.parametrize("num_tokens", [70, 400])   # slices of every expert / whole experts
def test_one_expert_per_token_is_bit_exact(weights, num_tokens):
    w1, w2 = weights
    x, w, ids = _routing(num_tokens, 1, seed=2)        # k = 1, renormalised: weight 1.0
    out = fused_experts_bf16(x, w1, w2, w, ids)
    assert torch.equal(out, _pair_outputs(x, w1, w2, ids)[:, 0])


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 150])
def test_top_k_sum_within_one_rounding(weights, num_tokens):
    w1, w2 = weights
    x, w, ids = _routing(num_tokens, 2, seed=num_tokens)
    out = fused_experts_bf16(x, w1, w2, w, ids)
    ref = (w[:, :, None] * _pair_outputs(x, w1, w2, ids).float()).sum(1)    # fp32 sum
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-6)
    # and against plain fp32 maths, within bf16 error
    fp32 = fused_moe_py.fused_experts(x.float(), w1.float(), w2.float(), w, ids)
    torch.testing.assert_close(out.float(), fp32, rtol=0.03, atol=0.02)


def test_idle_experts_and_thread_counts(weights):
    w1, w2 = weights
    x, w, _ = _routing(40, 2, seed=5)
    ids = torch.randint(0, 3, (40, 2), generator=torch.Generator().manual_seed(6))  # 5 idle
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_experts_bf16(x, w1, w2, w, ids)
        decode = fused_experts_bf16(x[:1], w1, w2, w[:1], ids[:1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fused_experts_bf16(x, w1, w2, w, ids), one)
    try:
        torch.set_num_threads(3)        # more threads than cores: slices taken by other threads
        assert torch.equal(fused_experts_bf16(x, w1, w2, w, ids), one)
        assert torch.equal(fused_experts_bf16(x[:1], w1, w2, w[:1], ids[:1]), decode)
    finally:
        torch.set_num_threads(threads)


def test_expert_map_halves_sum_to_the_whole(weights):
    w1, w2 = weights
    x, w, ids = _routing(33, 2, seed=7)
    whole = fused_experts_bf16(x, w1, w2, w, ids)
    halves = []
    for rank in range(2):                      # rank r holds global experts 4r .. 4r + 3
        expert_map = torch.full((E,), -1, dtype=torch.int64)
        expert_map[4 * rank:4 * rank + 4] = torch.arange(4)
        halves.append(fused_experts_bf16(x, w1[4 * rank:4 * rank + 4].contiguous(),
                                         w2[4 * rank:4 * rank + 4].contiguous(), w, ids,
                                         expert_map))
    # each half is rounded to bf16 on its own: one rounding of the larger value apart
    scale = whole.float().abs().max().item()
    torch.testing.assert_close(halves[0].float() + halves[1].float(), whole.float(),
                               rtol=2 ** -7, atol=scale * 2 ** -8)


def test_fused_experts_dispatches_to_the_kernel_only_where_it_applies(weights):
    w1, w2 = weights
    x, w, ids = _routing(9, 2, seed=8)
    assert experts_supported(x, w1, w2)
    assert torch.equal(fused_moe_py.fused_experts(x, w1, w2, w, ids),
                       fused_experts_bf16(x, w1, w2, w, ids))
    assert not experts_supported(x.float(), w1, w2)                       # fp32 rows
    odd = torch.zeros(9, 80, dtype=torch.bfloat16)                        # H % 32 != 0
    assert not experts_supported(odd, torch.zeros(E, 2 * I, 80).bfloat16(),
                                 torch.zeros(E, 80, I).bfloat16())
    assert not experts_supported(x, w1.transpose(1, 2), w2)              # not [E, 2I, H]
