"""flash-linear-attention's KDA ops at vLLM's path (`third_party/.../ops/kda.py`), called as
vLLM's files call them: the gate and the gated output norm against transformers' Ling 3.0
modules; a prefill through `chunk_kda` and its continuation through `fused_recurrent_kda`
(a state pool addressed by slot) against one prefill of the whole sequences."""

import pytest
import torch
from transformers import BailingHybridConfig
from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
    BailingHybridForgetGate, BailingHybridRMSNormGated)

from minivllm.third_party.flash_linear_attention.ops.kda import (FusedRMSNormGated, chunk_kda,
                                                                 fused_kda_gate,
                                                                 fused_recurrent_kda)
from tests.model_executor.layers._helpers import layer_context


@pytest.mark.parametrize("safe_gate", [True, False], ids=["lower_bound", "softplus"])
def test_fused_kda_gate_matches_transformers(safe_gate):
    torch.manual_seed(0)
    config = BailingHybridConfig(hidden_size=32, num_attention_heads=3, head_dim=8,
                                 kda_safe_gate=safe_gate, kda_lower_bound=-5.0)
    gate = BailingHybridForgetGate(config)
    with torch.no_grad():
        for param in (gate.A_log, gate.dt_bias, gate.f_proj.weight):
            param.normal_()
    hidden = torch.randn(1, 7, 32)
    ours = fused_kda_gate(gate.f_proj(hidden)[0], gate.A_log.view(1, 1, 3, 1), 8,
                          g_bias=gate.dt_bias, lower_bound=-5.0 if safe_gate else None)
    assert ours.shape == (7, 3, 8) and ours.dtype == torch.float32 and (ours <= 0).all()
    torch.testing.assert_close(ours, gate(hidden)[0], atol=1e-6, rtol=1e-6)


def test_fused_rms_norm_gated_matches_transformers():
    torch.manual_seed(1)
    ref = BailingHybridRMSNormGated(8, eps=1e-6)
    with layer_context():
        norm = FusedRMSNormGated(8, eps=1e-6, activation="sigmoid")
    with torch.no_grad():
        ref.weight.normal_()
        norm.weight.copy_(ref.weight)
    x, g = torch.randn(1, 5, 3, 8), torch.randn(5, 3, 8)     # vLLM's [1, T, h, d] with [T, h, d]
    torch.testing.assert_close(norm(x, g), ref(x, g[None]), atol=1e-6, rtol=1e-6)
    with layer_context(), pytest.raises(ValueError, match="activation"):
        FusedRMSNormGated(8, activation="relu")


def test_prefill_then_recurrent_decode_equals_one_prefill():
    """Two sequences (9 and 70 tokens) prefilled at once, then both decode 3 tokens each from a
    state pool where they sit in slots 4 and 1: the outputs and final states are those of one
    prefill over all 12 and 73 tokens."""
    torch.manual_seed(2)
    h, d, lens, steps = 2, 8, (9, 70), 3
    total = [n + steps for n in lens]
    q, k, v = (torch.randn(1, sum(total), h, d) for _ in range(3))
    g = -5 * torch.sigmoid(torch.randn(1, sum(total), h, d))
    beta = torch.rand(1, sum(total), h)
    full_cu = torch.tensor([0, total[0], sum(total)])
    ref_o, ref_state = chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(2, h, d, d),
                                 output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 cu_seqlens=full_cu)
    # token rows of each phase: the prompts, then decode step s of both sequences
    prompt_rows = torch.cat([torch.arange(lens[0]), total[0] + torch.arange(lens[1])])
    pick = lambda rows: [x[:, rows] for x in (q, k, v, g, beta)]       # noqa: E731
    o, states = chunk_kda(*pick(prompt_rows), initial_state=torch.zeros(2, h, d, d),
                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                          cu_seqlens=torch.tensor([0, lens[0], sum(lens)]))
    torch.testing.assert_close(o[0], ref_o[0, prompt_rows], atol=1e-5, rtol=1e-5)
    pool, slots = torch.zeros(6, h, d, d), torch.tensor([4, 1])
    pool[slots] = states
    for s in range(steps):
        rows = torch.tensor([lens[0] + s, total[0] + lens[1] + s])
        o, _ = fused_recurrent_kda(*pick(rows), initial_state=pool,
                                   use_qk_l2norm_in_kernel=True,
                                   cu_seqlens=torch.tensor([0, 1, 2]), ssm_state_indices=slots)
        torch.testing.assert_close(o[0], ref_o[0, rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], ref_state, atol=1e-5, rtol=1e-5)
