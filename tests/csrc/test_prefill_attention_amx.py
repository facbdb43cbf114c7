"""The native AMX attention for fresh prompts: against the fp64 reference and SDPA, that the
layer routes exactly the fresh prompts through it, and the cases it leaves to SDPA."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels import attention as attn_ops
from tests.model_executor.layers.attention.test_attention import Batch, make_config, make_layer

pytestmark = pytest.mark.requires_native


@pytest.fixture(autouse=True)
def _amx():
    if not ops._has_amx:
        pytest.skip("this CPU (or kernel) offers no AMX: prompts then keep SDPA")


def _reference(q, k, v, num_heads, num_kv_heads, d, scale):
    """fp64 causal GQA attention of one prompt; q/k/v [L, heads * d] -> [L, nH * d]."""
    L, group = q.shape[0], num_heads // num_kv_heads
    qh = q.double().view(L, num_heads, d).transpose(0, 1)
    kh = k.double().view(L, num_kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
    vh = v.double().view(L, num_kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
    s = (qh @ kh.transpose(1, 2) * scale).masked_fill(
        torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ vh).transpose(0, 1).reshape(L, num_heads * d)


@pytest.mark.parametrize("L,nH,nKV,d", [(1, 9, 3, 64), (5, 9, 3, 64), (16, 4, 4, 64),
                                        (17, 9, 3, 64), (137, 9, 3, 64), (300, 8, 2, 128),
                                        (33, 2, 1, 128)])
def test_kernel_matches_fp64_reference_like_sdpa(L, nH, nKV, d):
    gen = torch.Generator().manual_seed(L * 31 + d)
    qkv = torch.randn(L, (nH + 2 * nKV) * d, generator=gen).bfloat16()
    q, k, v = qkv.split([nH * d, nKV * d, nKV * d], dim=1)     # strided rows, as in a model
    wide = torch.full((L, nH * d + 16), float("nan"), dtype=torch.bfloat16)
    out = wide[:, 8:8 + nH * d]                                 # strided output rows too
    attn_ops.prefill_attention_bf16(q, k, v, out, nH, nKV, d, d ** -0.5)
    ref = _reference(q, k, v, nH, nKV, d, d ** -0.5)
    sdpa = F.scaled_dot_product_attention(
        q.view(L, nH, d).transpose(0, 1), k.view(L, nKV, d).transpose(0, 1),
        v.view(L, nKV, d).transpose(0, 1), is_causal=True, enable_gqa=True)
    sdpa = sdpa.transpose(0, 1).reshape(L, nH * d)
    err, sdpa_err = ((out.double() - ref).abs().max().item(),
                     (sdpa.double() - ref).abs().max().item())
    assert err <= 1.5 * sdpa_err + 1e-3 and err < 2e-2
    assert wide[:, :8].isnan().all() and wide[:, 8 + nH * d:].isnan().all()  # nothing else written


@pytest.fixture()
def calls(monkeypatch):
    seen = []
    real = attn_ops.prefill_attention_bf16
    monkeypatch.setattr(attn_ops, "prefill_attention_bf16",
                        lambda q, *a: seen.append(q.shape[0]) or real(q, *a))
    return seen


# Fresh prompts of 17, 33 and 70 tokens beside a chunked prefill (13 cached), decodes, and a
# fresh prompt of 5 (short chunks share one padded SDPA group: not the kernel's).
MIXED = ([17, 1, 33, 7, 1, 70, 1, 5], [17, 40, 33, 20, 9, 70, 130, 5])


def test_layer_routes_each_fresh_prompt_through_the_kernel(calls, monkeypatch):
    cfg = make_config()
    batch = Batch(*MIXED, nH=9, nKV=3, d=64, dtype=torch.bfloat16, seed=5)
    layer = make_layer(cfg, num_heads=9, head_size=64, scale=0.125, num_kv_heads=3)
    out = batch.run(cfg, layer)
    assert sorted(calls) == [17, 33, 70]
    torch.testing.assert_close(out.double(), batch.expected(0.125), atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(attn_ops, "prefill_attention_supported", lambda *a: False)
    sdpa = batch.run(cfg, layer)
    assert sorted(calls) == [17, 33, 70]
    torch.testing.assert_close(out.float(), sdpa.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, 16), (torch.float32, None)])
def test_windowed_or_fp32_prompts_keep_sdpa(calls, dtype, window):
    cfg = make_config()
    batch = Batch(*MIXED, nH=9, nKV=3, d=64, dtype=dtype, seed=6)
    layer = make_layer(cfg, num_heads=9, head_size=64, scale=0.125, num_kv_heads=3,
                       per_layer_sliding_window=window)
    out = batch.run(cfg, layer)
    assert calls == []
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.double(), batch.expected(0.125, window=window), atol=tol,
                               rtol=tol)
