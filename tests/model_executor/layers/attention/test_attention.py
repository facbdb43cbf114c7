"""Attention layer + CPU paged backend against a dense per-sequence reference (fp64)."""

import itertools

import pytest
import torch
from transformers import LlamaConfig

from minivllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.forward_context import set_forward_context
from minivllm.model_executor.layers.attention import Attention, EncoderOnlyAttention
from minivllm.model_executor.layers.attention.backends import (CommonAttentionMetadata,
                                                               TorchAttentionBackend,
                                                               TorchAttentionMetadataBuilder)
from minivllm.model_executor.layers.attention.encoder_only_attention import (
    Attention as ReexportedAttention)
from minivllm.v1.attention.backend import AttentionType

BLOCK_SIZE = 4
HEAD = 8
_ids = itertools.count()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds barrier waits (slow on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_config() -> VllmConfig:
    ensure_model_parallel_initialized(1, 1)
    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    return VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf))


def make_layer(cfg: VllmConfig, cls: type = Attention, **kwargs) -> Attention:
    kwargs.setdefault("prefix", f"model.layers.{next(_ids)}.self_attn.attn")
    with set_current_vllm_config(cfg):
        return cls(**kwargs)


def reference(q, k, v, q_lens, seq_lens, scale, window=None, causal=True, soft_cap=None,
              alibi=None):
    """Dense attention per sequence. q: list of [q_len, nH, d]; k/v: list of [seq_len, nKV, d]."""
    outs = []
    for qs, ks, vs, ql, sl in zip(q, k, v, q_lens, seq_lens):
        g = qs.shape[1] // ks.shape[1]
        ks, vs = ks.double().repeat_interleave(g, 1), vs.double().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qs.double(), ks) * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        qp = torch.arange(sl - ql, sl)[:, None]
        kp = torch.arange(sl)[None, :]
        if alibi is not None:
            s = s + torch.tensor(alibi, dtype=torch.float64)[:, None, None] * (kp - qp)
        mask = kp <= qp if causal else torch.ones(ql, sl, dtype=torch.bool)
        if window:
            mask = mask & (kp > qp - window)
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs).reshape(ql, -1))
    return torch.cat(outs)


class Batch:
    """Random sequences, paged into shuffled blocks; cached prefixes written up front."""

    def __init__(self, q_lens, seq_lens, nH, nKV, d=HEAD, dv=None, dtype=torch.float32, seed=0,
                 shuffle=True):
        gen = torch.Generator().manual_seed(seed)
        dv = dv or d
        self.q_lens, self.seq_lens = q_lens, seq_lens
        blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
        num_blocks = sum(blocks) + 3
        shape_blocks = num_blocks + 1
        # block 0 stays unused; unshuffled ids are consecutive from 1
        perm = (torch.randperm(num_blocks, generator=gen) if shuffle
                else torch.arange(1, num_blocks + 1))
        table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        used = 0
        for i, nb in enumerate(blocks):
            table[i, :nb] = perm[used:used + nb]
            used += nb
        shape = TorchAttentionBackend.get_kv_cache_shape(shape_blocks, BLOCK_SIZE, nKV, d,
                                                         head_size_v=dv)
        self.kv_cache = torch.zeros(shape, dtype=dtype)
        self.k = [torch.randn(s, nKV, d, generator=gen).to(dtype) for s in seq_lens]
        self.v = [torch.randn(s, nKV, dv, generator=gen).to(dtype) for s in seq_lens]
        self.q = [torch.randn(ql, nH, d, generator=gen).to(dtype) for ql in q_lens]
        self.slots_all = [table[i, torch.arange(s) // BLOCK_SIZE].long() * BLOCK_SIZE
                          + torch.arange(s) % BLOCK_SIZE for i, s in enumerate(seq_lens)]
        for i, (ql, s) in enumerate(zip(q_lens, seq_lens)):     # cached prefix of each sequence
            ctx = self.slots_all[i][:s - ql]
            self.kv_cache[0].view(-1, nKV, shape[-1])[ctx, :, :d] = self.k[i][:s - ql]
            self.kv_cache[1].view(-1, nKV, shape[-1])[ctx, :, :dv] = self.v[i][:s - ql]
        self.slot_mapping = torch.cat([sl[s - ql:] for sl, ql, s
                                       in zip(self.slots_all, q_lens, seq_lens)])
        self.common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
            slot_mapping=self.slot_mapping, num_actual_tokens=sum(q_lens),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens))

    def inputs(self):
        """q, k, v as column slices of one qkv tensor, like a model's qkv_proj output."""
        q = torch.cat(self.q).flatten(1)
        k = torch.cat([k[s - ql:] for k, ql, s in zip(self.k, self.q_lens, self.seq_lens)])
        v = torch.cat([v[s - ql:] for v, ql, s in zip(self.v, self.q_lens, self.seq_lens)])
        qkv = torch.cat([q, k.flatten(1), v.flatten(1)], dim=1)
        return qkv.split([q.shape[1], k[0].numel(), v[0].numel()], dim=1)

    def run(self, cfg, layer, metadata=None, wrap=lambda md, name: {name: md}):
        if metadata is None:
            metadata = TorchAttentionMetadataBuilder(BLOCK_SIZE).build(self.common)
        layer.bind_kv_cache(self.kv_cache)
        with set_forward_context(wrap(metadata, layer.layer_name), cfg,
                                 slot_mapping={layer.layer_name: self.slot_mapping}):
            return layer(*self.inputs())

    def expected(self, scale, **kwargs):
        return reference(self.q, self.k, self.v, self.q_lens, self.seq_lens, scale, **kwargs)


# A fresh prefill, a chunked prefill on a cached prefix, decodes (one of length 1).
MIXED = ([7, 5, 1, 1, 1, 1, 3], [7, 14, 1, 13, 17, 30, 3])
# 40 decodes of very different lengths around a chunked prefill.
SPREAD = ([1] * 20 + [5] + [1] * 20, list(range(3, 803, 40)) + [9] + list(range(790, 2, -40)))
EQUAL = ([1] * 70, [120] * 70)
# Prefills longer than _MAX_PADDED_PREFILL get a group each: fresh, chunked, fresh, plus a short one.
LONG = ([20, 1, 33, 1, 18, 3], [20, 9, 50, 30, 18, 10])


@pytest.mark.parametrize("nH,nKV", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("lens", [MIXED, ([6], [6]), ([6], [11]), ([6, 3, 9], [6, 3, 9]),
                                  SPREAD, EQUAL, LONG])
def test_matches_reference(nH, nKV, window, lens):
    cfg = make_config()
    batch = Batch(*lens, nH=nH, nKV=nKV)
    layer = make_layer(cfg, num_heads=nH, head_size=HEAD, scale=0.3, num_kv_heads=nKV,
                       per_layer_sliding_window=window)
    md = TorchAttentionMetadataBuilder(BLOCK_SIZE).build(batch.common)
    if lens is SPREAD:      # decode rows are bucketed by length (sorted, so gathered by index)
        assert len(md.groups) >= 3 and md.groups[0].row_start is None
    if lens is EQUAL:       # many keys: cut into buckets that stay slices of the rows
        assert len(md.groups) == 2 and md.groups[1].row_start == 35
    if lens is LONG:        # 1 decode bucket, 1 padded short group, 3 single prefills
        assert [g.num_seqs for g in md.groups] == [2, 1, 1, 1, 1]
    out = batch.run(cfg, layer, md)
    torch.testing.assert_close(out.double(), batch.expected(0.3, window=window),
                               atol=1e-5, rtol=1e-5)
    # Every token of every sequence is now in its slot.
    cache_k = batch.kv_cache[0].view(-1, nKV, HEAD)
    cache_v = batch.kv_cache[1].view(-1, nKV, HEAD)
    for slots, k, v in zip(batch.slots_all, batch.k, batch.v):
        assert torch.equal(cache_k[slots], k) and torch.equal(cache_v[slots], v)


@pytest.mark.parametrize("lens", [([1], [23]), ([6], [23])])
def test_single_sequence_on_consecutive_blocks_is_not_gathered(lens):
    cfg = make_config()
    batch = Batch(*lens, nH=6, nKV=2, shuffle=False)
    layer = make_layer(cfg, num_heads=6, head_size=HEAD, scale=0.3, num_kv_heads=2,
                       per_layer_sliding_window=7)
    md = TorchAttentionMetadataBuilder(BLOCK_SIZE).build(batch.common)
    assert md.groups[0].block_start == 1
    torch.testing.assert_close(batch.run(cfg, layer, md).double(), batch.expected(0.3, window=7),
                               atol=1e-5, rtol=1e-5)


def test_bfloat16_and_window_from_cache_config():
    cfg = make_config()
    cfg.cache_config.sliding_window = 6
    batch = Batch(*MIXED, nH=6, nKV=2, dtype=torch.bfloat16)
    layer = make_layer(cfg, num_heads=6, head_size=HEAD, scale=0.3, num_kv_heads=2,
                       cache_config=cfg.cache_config)
    assert layer.sliding_window == 6 and layer.kv_cache_torch_dtype == torch.float32
    out = batch.run(cfg, layer)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), batch.expected(0.3, window=6), atol=3e-2, rtol=3e-2)


def test_soft_cap_alibi_and_head_size_v():
    cfg = make_config()
    batch = Batch(*MIXED, nH=6, nKV=2, dv=2 * HEAD)
    layer = make_layer(cfg, num_heads=6, head_size=HEAD, scale=0.3, num_kv_heads=2,
                       head_size_v=2 * HEAD)
    torch.testing.assert_close(batch.run(cfg, layer).double(), batch.expected(0.3),
                               atol=1e-5, rtol=1e-5)
    capped = make_layer(cfg, num_heads=6, head_size=HEAD, scale=0.3, num_kv_heads=2,
                        logits_soft_cap=2.0, per_layer_sliding_window=4)
    batch = Batch(*MIXED, nH=6, nKV=2)
    torch.testing.assert_close(batch.run(cfg, capped).double(),
                               batch.expected(0.3, window=4, soft_cap=2.0), atol=1e-5, rtol=1e-5)
    slopes = [0.5, 0.25, 0.125, 0.0625, 0.03, 0.01]
    alibi = make_layer(cfg, num_heads=6, head_size=HEAD, scale=0.3, num_kv_heads=2,
                       alibi_slopes=slopes)
    batch = Batch(*MIXED, nH=6, nKV=2)
    torch.testing.assert_close(batch.run(cfg, alibi).double(),
                               batch.expected(0.3, alibi=slopes), atol=1e-5, rtol=1e-5)


def test_metadata_forms_and_profiling_run():
    cfg = make_config()
    layer = make_layer(cfg, num_heads=4, head_size=HEAD, scale=0.3, num_kv_heads=2)
    batch = Batch(*MIXED, nH=4, nKV=2)
    md = TorchAttentionMetadataBuilder(BLOCK_SIZE).build(batch.common)
    expected = batch.expected(0.3)
    for wrap in (lambda m, n: {n: m}, lambda m, n: [{n: m}], lambda m, n: m):
        out = batch.run(cfg, layer, md, wrap)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    q, k, v = batch.inputs()
    with set_forward_context(None, cfg):
        out = layer(q, k, v)
    assert out.shape == (q.shape[0], 4 * HEAD) and not out.any()


def test_registration_errors():
    cfg = make_config()
    make_layer(cfg, num_heads=4, head_size=HEAD, scale=1.0, prefix="model.layers.0.attn")
    assert cfg.compilation_config.static_forward_context["model.layers.0.attn"].layer_name == \
        "model.layers.0.attn"
    with pytest.raises(ValueError, match="Duplicate layer name: model.layers.0.attn"):
        make_layer(cfg, num_heads=4, head_size=HEAD, scale=1.0, prefix="model.layers.0.attn")
    with pytest.raises(ValueError, match="prefix"):
        make_layer(cfg, num_heads=4, head_size=HEAD, scale=1.0, prefix="")
    with pytest.raises(AssertionError):
        make_layer(cfg, num_heads=4, head_size=HEAD, scale=1.0, num_kv_heads=3)


def test_layer_attributes_and_buffers():
    cfg = make_config()
    layer = make_layer(cfg, num_heads=4, head_size=HEAD, scale=1.0, num_kv_heads=2)
    assert dict(layer.named_parameters()) == {}
    assert {n for n, _ in layer.named_buffers()} == {"_k_scale", "_v_scale", "_q_scale",
                                                     "_prob_scale"}
    assert layer.kv_cache.numel() == 0 and layer.impl.num_queries_per_kv == 2
    assert layer.get_kv_cache_shape(10, 16) == (2, 10, 16, 2, HEAD)
    assert ReexportedAttention is Attention


def test_encoder_only_matches_reference():
    cfg = make_config()
    layer = make_layer(cfg, EncoderOnlyAttention, num_heads=6, head_size=HEAD, scale=0.3,
                       num_kv_heads=2, attn_type=AttentionType.ENCODER_ONLY)
    assert layer.attn_type == AttentionType.ENCODER_ONLY
    for lens in ([5, 9, 1], [6], [5, 20, 1, 17]):
        batch = Batch(lens, lens, nH=6, nKV=2)
        batch.common.causal = False
        md = TorchAttentionMetadataBuilder(BLOCK_SIZE).build(batch.common)
        q, k, v = batch.inputs()
        with set_forward_context({layer.layer_name: md}, cfg):   # no slot mapping needed
            out = layer(q, k, v)
        torch.testing.assert_close(out.double(), batch.expected(0.3, causal=False),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError):
        make_layer(cfg, EncoderOnlyAttention, num_heads=4, head_size=HEAD, scale=1.0,
                   attn_type=AttentionType.DECODER)
