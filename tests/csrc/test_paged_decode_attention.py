"""The native paged decode-attention kernel: correctness against the fp64 reference, that the
layer really routes decode rows through it, and the pure-PyTorch fallback when it cannot build."""

import pytest
import torch

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels import attention as attn_ops
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import (
    TorchAttentionMetadataBuilder)
from tests.model_executor.layers.attention.test_attention import (BLOCK_SIZE, Batch, make_config,
                                                                   make_layer)

# Decodes of lengths 1..~300 (many blocks, shuffled) around a chunked prefill and a fresh one.
LENS = ([1] * 9 + [7] + [1] * 9 + [12],
        [1, 2, 17, 64, 65, 130, 211, 299, 5, 20, 300, 3, 4, 250, 48, 49, 96, 97, 180, 12])


@pytest.fixture()
def calls(monkeypatch):
    """Counts kernel calls."""
    seen = []
    real = attn_ops.paged_decode_attention

    def counting(*args, **kwargs):
        seen.append(args[4].numel())                       # decode rows in this call
        return real(*args, **kwargs)

    monkeypatch.setattr(attn_ops, "paged_decode_attention", counting)
    return seen


# d=64/128 hit the AVX-512 specializations (G = 1, 3, 8 query heads per KV head), d=24 the
# portable loops.
@pytest.mark.requires_native
@pytest.mark.parametrize("d,nH,nKV", [(64, 9, 3), (64, 4, 4), (128, 8, 1), (24, 6, 2)])
@pytest.mark.parametrize("window", [None, 37])
def test_kernel_matches_reference_fp32(calls, d, nH, nKV, window):
    cfg = make_config()
    batch = Batch(*LENS, nH=nH, nKV=nKV, d=d, seed=d + nH)
    layer = make_layer(cfg, num_heads=nH, head_size=d, scale=d ** -0.5, num_kv_heads=nKV,
                       per_layer_sliding_window=window)
    out = batch.run(cfg, layer)
    assert calls == [18]                                     # one call for all 18 decode rows
    torch.testing.assert_close(out.double(), batch.expected(d ** -0.5, window=window),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.requires_native
def test_kernel_bf16_close_to_reference_and_to_sdpa_path(calls, monkeypatch):
    cfg = make_config()
    batch = Batch(*LENS, nH=9, nKV=3, d=64, dtype=torch.bfloat16, seed=3)
    layer = make_layer(cfg, num_heads=9, head_size=64, scale=0.125, num_kv_heads=3)
    out = batch.run(cfg, layer)
    assert out.dtype == torch.bfloat16 and calls == [18]
    torch.testing.assert_close(out.double(), batch.expected(0.125), atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(layer.impl, "_kernel_ok", False)     # the gather + SDPA path
    sdpa = batch.run(cfg, layer)
    assert calls == [18]
    torch.testing.assert_close(out.float(), sdpa.float(), atol=1.6e-2, rtol=1.6e-2)


def test_unsupported_layers_keep_the_sdpa_path(calls):
    cfg = make_config()
    batch = Batch(*LENS, nH=6, nKV=2, d=16)
    capped = make_layer(cfg, num_heads=6, head_size=16, scale=0.25, num_kv_heads=2,
                        logits_soft_cap=3.0)
    out = batch.run(cfg, capped)
    assert calls == []
    torch.testing.assert_close(out.double(), batch.expected(0.25, soft_cap=3.0),
                               atol=1e-5, rtol=1e-5)


def test_no_compiler_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(ops, "_lib", None)
    monkeypatch.setattr(ops, "_tried", False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    assert not ops.native_available()
    assert "gather + SDPA" in caplog.text
    cfg = make_config()
    batch = Batch(*LENS, nH=6, nKV=2, d=64)
    layer = make_layer(cfg, num_heads=6, head_size=64, scale=0.125, num_kv_heads=2)
    torch.testing.assert_close(batch.run(cfg, layer).double(), batch.expected(0.125),
                               atol=1e-5, rtol=1e-5)
    md = TorchAttentionMetadataBuilder(BLOCK_SIZE).build(batch.common)
    assert md.decode is not None and md.decode.rows.numel() == 18 and len(md.decode_groups) >= 1


@pytest.mark.slow      # a second from-scratch build (~20 s); every native test uses the first
@pytest.mark.requires_native
def test_kernel_builds_into_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(ops, "_lib", None)
    monkeypatch.setattr(ops, "_tried", False)
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    assert ops.native_available()
    built = list(tmp_path.glob("minivllm_kernels-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("tmp*"))
    monkeypatch.setenv("MINIVLLM_CPU_KERNEL", "0")
    monkeypatch.setattr(ops, "_tried", False)
    monkeypatch.setattr(ops, "_lib", None)
    assert not ops.native_available()


@pytest.mark.requires_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_step_writes_new_rows_inside_the_kernel(calls, monkeypatch, dtype):
    # Every row a decode: the kernel writes each sequence's new key/value row to its slot before
    # reading (no separate scatter); with a prefill in the step the scatter runs first instead.
    cfg = make_config()
    lens = [1, 17, 64, 65, 130, 5, 33, 200, 2, 16]
    batch = Batch([1] * len(lens), lens, nH=9, nKV=3, d=64, dtype=dtype, seed=11)
    layer = make_layer(cfg, num_heads=9, head_size=64, scale=0.125, num_kv_heads=3)
    scatters = []
    real_update = layer.impl.do_kv_cache_update
    monkeypatch.setattr(layer.impl, "do_kv_cache_update",
                        lambda *a: scatters.append(1) or real_update(*a))
    out = batch.run(cfg, layer)
    assert calls == [len(lens)] and scatters == []
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.double(), batch.expected(0.125), atol=tol, rtol=tol)
    k_rows = batch.kv_cache[0].view(-1, 3 * 64)[batch.slot_mapping]
    v_rows = batch.kv_cache[1].view(-1, 3 * 64)[batch.slot_mapping]
    assert torch.equal(k_rows, torch.stack([k[-1] for k in batch.k]).flatten(1))
    assert torch.equal(v_rows, torch.stack([v[-1] for v in batch.v]).flatten(1))

    # keys from their own tensor (a compiled graph's rotary output), values a slice of qkv
    again = Batch([1] * len(lens), lens, nH=9, nKV=3, d=64, dtype=dtype, seed=11)
    q, k, v = again.inputs()
    monkeypatch.setattr(again, "inputs", lambda: (q, k.contiguous(), v))
    assert torch.equal(again.run(cfg, layer), out) and scatters == []

    mixed = Batch([1, 4, 1], [9, 4, 20], nH=9, nKV=3, d=64, dtype=dtype, seed=12)
    out = mixed.run(cfg, layer)
    assert scatters == [1]
    torch.testing.assert_close(out.double(), mixed.expected(0.125), atol=tol, rtol=tol)
