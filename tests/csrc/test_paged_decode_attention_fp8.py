"""fp8 KV caches (kv_cache_dtype "fp8" / "fp8_e4m3", "fp8_e5m2") in the native paged decode
kernel: a decode step's new bf16 rows rounded into the cache exactly as torch's casts round them
(ties, subnormals, signed zero), attention over the widened fp8 values, the same as the gather +
SDPA path; and an engine that keeps its cache in fp8."""

import pytest
import torch

from tests.csrc.test_paged_decode_attention import calls  # noqa: F401
from tests.model_executor.layers.attention.test_attention import Batch, make_config, make_layer

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Ties between neighbouring codes of either format (to the even code), subnormals and their
# ties, signed zero, values near e4m3's largest (448), ordinary values.
PLANTED = [0.0, -0.0, 1.0625, 1.1875, -1.0625, 1.125, 1.375, 2 ** -10, 3 * 2 ** -10,
           2 ** -7 * 1.0625, 2 ** -17, 3 * 2 ** -17, 440.0, -300.0, 0.3, -7.7]


# d=64: the AVX-512 loads; d=24: the portable loops (table lookups)
@pytest.mark.requires_native
@pytest.mark.parametrize("d,nH,nKV", [(64, 9, 3), (24, 6, 2)])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_fp8_cache_rows_and_attention(calls, monkeypatch, fp8, d, nH, nKV):  # noqa: F811
    cfg = make_config()
    lens = [1, 17, 64, 65, 130, 5, 33, 200, 2, 16]
    batch = Batch([1] * len(lens), lens, nH=nH, nKV=nKV, d=d, dtype=torch.bfloat16, seed=11)
    planted = torch.tensor(PLANTED * 12)[:nKV * d].view(nKV, d).bfloat16()
    batch.k[0][-1], batch.v[3][-1] = planted, -planted
    batch.kv_cache = batch.kv_cache.to(fp8)                  # the context, as torch rounds it
    layer = make_layer(cfg, num_heads=nH, head_size=d, scale=d ** -0.5, num_kv_heads=nKV)
    out = batch.run(cfg, layer)
    assert calls == [len(lens)] and out.dtype == torch.bfloat16
    for i, rows in ((0, batch.k), (1, batch.v)):          # the kernel wrote the new rows
        got = batch.kv_cache[i].view(-1, nKV * d)[batch.slot_mapping]
        want = torch.stack([r[-1] for r in rows]).flatten(1).to(fp8)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    batch.k = [k.to(fp8).bfloat16() for k in batch.k]       # attention sees the fp8 values
    batch.v = [v.to(fp8).bfloat16() for v in batch.v]
    torch.testing.assert_close(out.double(), batch.expected(d ** -0.5), atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(layer.impl, "_kernel_ok", False)     # the gather + SDPA path
    torch.testing.assert_close(batch.run(cfg, layer).float(), out.float(), atol=1.6e-2,
                               rtol=1.6e-2)
