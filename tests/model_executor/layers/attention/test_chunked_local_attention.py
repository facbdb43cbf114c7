"""`ChunkedLocalAttention` (Llama 4's RoPE layers) on the CPU backend against a dense masked
reference: a query at position p attends to keys at [p // C * C, p], in fresh prompts, prompts
chunked over a cached prefix, and decodes (fp64 reference)."""

import pytest
import torch

from minivllm.model_executor.layers.attention import Attention, ChunkedLocalAttention
from minivllm.model_executor.layers.attention.backends import TorchAttentionMetadataBuilder
from tests.model_executor.layers.attention.test_attention import (BLOCK_SIZE, HEAD, MIXED, SPREAD,
                                                                  Batch, _one_thread,  # noqa: F401
                                                                  make_config, make_layer)


def chunked_reference(batch: Batch, scale: float, chunk: int) -> torch.Tensor:
    """Dense causal attention per sequence, keys limited to the query's chunk."""
    outs = []
    for qs, ks, vs, ql, sl in zip(batch.q, batch.k, batch.v, batch.q_lens, batch.seq_lens):
        g = qs.shape[1] // ks.shape[1]
        ks, vs = ks.double().repeat_interleave(g, 1), vs.double().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qs.double(), ks) * scale
        qp, kp = torch.arange(sl - ql, sl)[:, None], torch.arange(sl)[None, :]
        allowed = (kp <= qp) & (kp // chunk == qp // chunk)      # [ql, sl]
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs).reshape(ql, -1))
    return torch.cat(outs)


# Fresh prompts crossing chunk ends, a prompt chunk on a cached prefix that starts mid-chunk,
# decodes at a chunk's first position (it sees only itself) and deep inside one.
CROSSING = ([13, 6, 1, 1, 1], [13, 21, 16, 17, 30])


@pytest.mark.parametrize("chunk", [4, 5, 8])
@pytest.mark.parametrize("lens", [CROSSING, MIXED, SPREAD, ([40], [40])],
                         ids=["crossing", "mixed", "spread", "one_prompt"])
def test_chunked_local_matches_masked_reference(chunk, lens):
    cfg = make_config()
    batch = Batch(*lens, nH=6, nKV=2)
    layer = make_layer(cfg, ChunkedLocalAttention, num_heads=6, head_size=HEAD, scale=0.3,
                       attention_chunk_size=chunk, num_kv_heads=2)
    md = TorchAttentionMetadataBuilder(BLOCK_SIZE).build(batch.common)
    out = batch.run(cfg, layer, md)
    torch.testing.assert_close(out.double(), chunked_reference(batch, 0.3, chunk),
                               atol=1e-5, rtol=1e-5)


def test_chunk_boundary_changes_the_result_and_long_chunks_are_plain_attention():
    """The mask matters (a 4-token chunk is not full attention), and a chunk longer than every
    sequence is exactly causal attention."""
    cfg = make_config()
    batch = Batch(*CROSSING, nH=4, nKV=4)
    full = batch.run(cfg, make_layer(cfg, Attention, num_heads=4, head_size=HEAD, scale=0.3))
    local = batch.run(cfg, make_layer(cfg, ChunkedLocalAttention, num_heads=4, head_size=HEAD,
                                      scale=0.3, attention_chunk_size=4))
    long = batch.run(cfg, make_layer(cfg, ChunkedLocalAttention, num_heads=4, head_size=HEAD,
                                     scale=0.3, attention_chunk_size=64))
    assert not torch.allclose(local, full, atol=1e-3)
    torch.testing.assert_close(long, full)


def test_bfloat16_decodes_skip_the_native_kernel():
    """The native decode kernel has no chunk input: chunked layers take the masked SDPA path
    (the same numbers as the fp32 reference, to bf16 precision)."""
    cfg = make_config()
    batch = Batch([1, 1, 1], [9, 16, 25], nH=4, nKV=2, dtype=torch.bfloat16)
    layer = make_layer(cfg, ChunkedLocalAttention, num_heads=4, head_size=HEAD, scale=0.3,
                       attention_chunk_size=8, num_kv_heads=2)
    assert layer.impl._kernel_ok is False
    out = batch.run(cfg, layer)
    torch.testing.assert_close(out.double(), chunked_reference(batch, 0.3, 8), atol=3e-2,
                               rtol=3e-2)


@pytest.mark.parametrize("bad", [0, -8, None])
def test_bad_chunk_size_is_refused(bad):
    with pytest.raises(ValueError, match="attention_chunk_size must be a positive int"):
        make_layer(make_config(), ChunkedLocalAttention, num_heads=4, head_size=HEAD, scale=0.3,
                   attention_chunk_size=bad)
