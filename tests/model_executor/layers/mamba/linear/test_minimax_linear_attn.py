"""vLLM's MiniMax linear-attention helpers on minivllm, against the fp64 recurrence: a step
in vLLM's batch order (decodes first, then a prefill chunk continuing its state and a new
sequence whose stale slot is cleared), the decode helper on a slice of rows, the per-sequence
prefill kernel, and the MiniMax-Text-01 layer written out."""

from types import SimpleNamespace

import pytest
import torch

from minivllm.model_executor.layers.mamba.linear import minimax_linear_attn as mm
from minivllm.v1.attention.backends.linear_attn import LinearAttentionMetadataBuilder
from minivllm.worker.state_slots import StateSlots
from tests.model_executor.layers._helpers import layer_context
from tests.model_executor.layers._lightning_reference import SLOPES, qkv, recurrence_fp64


def _states(seed: int = 3) -> torch.Tensor:
    return torch.randn(6, 4, 16, 16, generator=torch.Generator().manual_seed(seed))


def test_prefill_and_mix_in_vllm_batch_order():
    cache = _states()
    before = cache.clone()
    slots = StateSlots(6)
    for req in ("d0", "d1", "p0", "new"):                 # slots 0, 1, 2, 3 (3 holds junk)
        slots.slot(req)
    lens, computed = [1, 1, 20, 11], [7, 3, 16, 0]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    md = LinearAttentionMetadataBuilder().build(
        slots.metadata(["d0", "d1", "p0", "new"], computed, qsl))
    assert (md.num_decodes, md.num_prefills) == (2, 2)
    mm.clear_linear_attention_cache_for_new_sequences(cache, md.state_indices_tensor, md)
    assert torch.all(cache[3] == 0) and torch.equal(cache[:3], before[:3])
    q, k, v = qkv(sum(lens), seed=4)
    out = mm.linear_attention_prefill_and_mix(q, k, v, cache, md.state_indices_tensor, md,
                                              SLOPES, block_size=256)
    assert out.shape == (sum(lens), 4 * 16)
    for i, start in enumerate(qsl[:-1].tolist()):
        rows, slot = slice(start, start + lens[i]), int(md.state_indices_tensor[i])
        init = before[slot] if computed[i] else torch.zeros(4, 16, 16)
        ref_out, ref_state = recurrence_fp64(q[rows], k[rows], v[rows], SLOPES, init)
        assert (out[rows] - ref_out.flatten(1)).abs().max() < 2e-5, f"row {i}"
        assert (cache[slot] - ref_state).abs().max() < 2e-5, f"state of row {i}"


def test_decode_helper_on_a_slice_of_rows():
    cache = _states(5)
    before = cache.clone()
    q, k, v = qkv(5, seed=6)
    slot_ids = torch.tensor([4, 2, 0, 1, 3])
    out = mm.linear_attention_decode(q, k, v, cache, SLOPES, slot_ids, q_start=0, q_end=2,
                                     slot_start=0, slot_end=2)
    assert out.shape == (2, 64)
    for row, slot in ((0, 4), (1, 2)):
        ref_out, ref_state = recurrence_fp64(q[row:row + 1], k[row:row + 1], v[row:row + 1],
                                             SLOPES, before[slot])
        assert (out[row] - ref_out.flatten()).abs().max() < 1e-5
        assert (cache[slot] - ref_state).abs().max() < 1e-5
    assert torch.equal(cache[[0, 1, 3]], before[[0, 1, 3]])


def test_prefix_kernel_continues_the_state_in_place():
    state = _states(7)[0]
    before = state.clone()
    q, k, v = qkv(40, seed=8)
    out = mm.MiniMaxText01LinearKernel.jit_linear_forward_prefix(
        *(x.transpose(0, 1) for x in (q, k, v)), state, SLOPES.view(4, 1, 1), block_size=16)
    ref_out, ref_state = recurrence_fp64(q, k, v, SLOPES, before)
    assert out.shape == (40, 64) and (out - ref_out.flatten(1)).abs().max() < 2e-5
    assert (state - ref_state).abs().max() < 2e-5


@pytest.fixture
def minimax_layer():
    with layer_context() as config:
        hf = SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=16,
                             num_hidden_layers=3)
        layer = mm.MiniMaxText01LinearAttention(hf, config, prefix="model.layers.1.self_attn")
    gen = torch.Generator().manual_seed(9)
    for p in layer.parameters():
        p.data = 0.1 * torch.randn(p.shape, generator=gen) + (1 if p.dim() == 1 else 0)
    return layer


def test_minimax_layer_matches_written_out_fp64(minimax_layer):
    layer, n = minimax_layer, 50
    # layer 1 of 3: slopes scaled by 1 - 1/2 (+1e-5) from ALiBi's 2^(-8 i / 4)
    slopes = torch.tensor([2 ** (-2 * (i + 1)) for i in range(4)]) * (0.5 + 1e-5)
    assert torch.allclose(layer.tp_slope.flatten(), slopes)
    assert layer.kv_cache[0].shape[1:] == (4, 16, 16)
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(10))
    out = torch.zeros_like(x)
    with torch.no_grad():
        layer(x, out, torch.arange(n))
    xd = x.double()
    q, k, v = torch.nn.functional.silu(xd @ layer.qkv_proj.weight.double().T).view(
        n, 4, 48).split(16, dim=-1)
    o, _ = recurrence_fp64(q, k, v, slopes, torch.zeros(4, 16, 16))
    o = o.flatten(1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.norm.weight.double()
    o = o * torch.sigmoid(xd @ layer.output_gate.weight.double().T)
    ref = o @ layer.out_proj.weight.double().T
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
