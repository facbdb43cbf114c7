"""Lightning attention's torch forms against a plain fp64 token-by-token run of the recurrence
S_t = exp(-slope) S_{t-1} + k_t^T v_t, o_t = q_t S_t: the chunked prefill form, the varlen
frame over a mixed batch (decodes, a prefill chunk continuing a state, a fresh prompt) with
the states in their slots, and vLLM's decode entry point."""

import time

import pytest
import torch

from minivllm.model_executor.layers.lightning_attn import (PAD_SLOT_ID, lightning_attention,
                                                           linear_attention_varlen,
                                                           linear_decode_forward_triton)
from minivllm.v1.attention.backends.linear_attn import LinearAttentionMetadataBuilder
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata
from tests.model_executor.layers._lightning_reference import SLOPES, qkv, recurrence_fp64

@pytest.mark.parametrize("n, block", [(100, 32), (64, 64), (7, 256)])
def test_chunked_prefill_matches_recurrence(n, block):
    q, k, v = qkv(n)
    init = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(5))
    out, state = lightning_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), SLOPES,
                                     block_size=block, kv_history=init[None])
    ref_out, ref_state = recurrence_fp64(q, k, v, SLOPES, init)
    err = (out[0].transpose(0, 1) - ref_out).abs().max().item()
    print(f"\nchunked vs fp64 recurrence, n={n} block={block}: max |diff| {err:.2e}")
    assert out.dtype == torch.float32 and err < 2e-5
    assert (state[0] - ref_state).abs().max().item() < 2e-5


def _mixed_batch(states: torch.Tensor) -> tuple[ShortConvAttentionMetadata, list[int]]:
    """Rows: a decode (slot 2), a 70-token prefill chunk continuing slot 0, a decode (slot 4),
    a fresh 9-token prompt in slot 1 (whose stale slot content must be ignored)."""
    lens, slots, has_state = [1, 70, 1, 9], [2, 0, 4, 1], [True, True, True, False]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    md = ShortConvAttentionMetadata(qsl, torch.tensor(slots), torch.tensor(has_state),
                                    sum(lens), seq_lens=torch.tensor([31, 90, 5, 9]))
    return md, lens


def test_varlen_mixed_batch_matches_per_sequence_recurrence():
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(6, 4, 16, 16, generator=gen)
    before = states.clone()
    md, lens = _mixed_batch(states)
    q, k, v = qkv(sum(lens), seed=4)
    out = linear_attention_varlen(q, k, v, SLOPES, states, LinearAttentionMetadataBuilder()
                                  .build(md), write_state=True)
    for i, (start, n) in enumerate(zip(md.query_start_loc[:-1].tolist(), lens)):
        slot = int(md.state_indices[i])
        init = before[slot] if md.has_initial_state[i] else torch.zeros(4, 16, 16)
        rows = slice(start, start + n)
        ref_out, ref_state = recurrence_fp64(q[rows], k[rows], v[rows], SLOPES, init)
        assert (out[rows] - ref_out).abs().max() < 2e-5, f"row {i}"
        assert (states[slot] - ref_state).abs().max() < 2e-5, f"state of row {i}"
    assert torch.equal(states[[3, 5]], before[[3, 5]])          # slots of no sequence


def test_varlen_without_write_leaves_states():
    states = torch.randn(6, 4, 16, 16)
    before = states.clone()
    md, lens = _mixed_batch(states)
    linear_attention_varlen(*qkv(sum(lens)), SLOPES, states, md, write_state=False)
    assert torch.equal(states, before)


def test_decode_entry_point_updates_slots_and_skips_padding():
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(5, 4, 16, 16, generator=gen)
    before = cache.clone()
    q, k, v = (x[:, :, None] for x in qkv(3, seed=8))          # [B, H, 1, D]
    slot_idx = torch.tensor([3, PAD_SLOT_ID, 0])
    out = linear_decode_forward_triton(q, k, v, cache, SLOPES, slot_idx)
    assert out.shape == (3, 4 * 16) and torch.all(out[1] == 0)
    for row, slot in ((0, 3), (2, 0)):
        ref_out, ref_state = recurrence_fp64(q[row, :, 0][None], k[row, :, 0][None],
                                             v[row, :, 0][None], SLOPES, before[slot])
        assert (out[row] - ref_out.flatten()).abs().max() < 1e-5
        assert (cache[slot] - ref_state).abs().max() < 1e-5
    assert torch.equal(cache[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.slow     # a timing note (printed, not asserted): run with -s
def test_time_chunked_vs_step_by_step_one_thread():
    """1024 tokens x 8 heads x 64 dim on one thread: the chunked form against a loop of
    single recurrent steps (what a token-by-token prefill would cost)."""
    from minivllm.model_executor.layers.lightning_attn import linear_attention_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n, h, d = 1024, 8, 64
        q, k, v = qkv(n, h, d, seed=9)
        slopes = torch.linspace(0.5, 1e-3, h)
        args = [x.transpose(0, 1)[None] for x in (q, k, v)]
        lightning_attention(*args, slopes, block_size=64)                   # warm-up
        t0 = time.perf_counter()
        out, _ = lightning_attention(*args, slopes, block_size=64)
        t_chunk = time.perf_counter() - t0
        g = (-slopes)[None].expand(1, h)
        state, outs = torch.zeros(1, h, d, d), []
        t0 = time.perf_counter()
        for t in range(n):
            o, state = linear_attention_step(q[t][None], k[t][None], v[t][None], g, state)
            outs.append(o)
        t_step = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    err = (out[0].transpose(0, 1) - torch.cat(outs)).abs().max().item()
    print(f"\n1024 x 8 x 64, 1 thread: chunked {t_chunk * 1e3:.1f} ms, step by step "
          f"{t_step * 1e3:.1f} ms, max |diff| {err:.2e}")
    assert err < 1e-4
