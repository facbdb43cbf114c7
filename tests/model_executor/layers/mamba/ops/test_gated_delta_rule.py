"""The gated delta rule (`ops/gated_delta_rule.py`) against a plain token-by-token recurrence
on a batch mixing fresh prefills, continued chunks and single-token decodes, with grouped
key heads and L2-normalised q / k, the per-sequence states read from and written back to their
slots; and the chunked form alone against the recurrence across several chunks."""

import pytest
import torch

from minivllm.model_executor.layers.mamba.ops.gated_delta_rule import (
    chunk_gated_delta_rule, gated_delta_rule_varlen)
from tests.model_executor.layers.mamba.ops._varlen_batch import (HAS_STATE, LENS, SLOTS,
                                                                 step_metadata)


def _recurrent(q, k, v, g, beta, state):
    """The rule one token at a time: q / k [L, h, dk] (ready to use), v [L, h, dv],
    state [h, dv, dk]."""
    outs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]
        err = v[t] - torch.einsum("hvk,hk->hv", state, k[t])
        state = state + (err * beta[t][:, None])[:, :, None] * k[t][:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", state, q[t]))
    return torch.stack(outs), state


def _prepare(q, k, rep):
    """What the op does to q / k before the rule: L2 norm, grouped heads, q * dk^-1/2."""
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q * q.shape[-1] ** -0.5, k


def _inputs(total, hk, hv, dk, dv):
    q, k = torch.randn(total, hk, dk), torch.randn(total, hk, dk)
    v = torch.randn(total, hv, dv)
    g = -torch.rand(total, hv) * 0.5                      # log decay <= 0
    beta = torch.rand(total, hv)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [64, 16])
def test_varlen_gated_delta_rule_matches_the_recurrence(chunk):
    torch.manual_seed(0)
    hk, hv, dk, dv, total = 2, 4, 8, 6, sum(LENS)
    q, k, v, g, beta = _inputs(total, hk, hv, dk, dv)
    state = torch.randn(5, hv, dv, dk)
    md = step_metadata()
    out_state = state.clone()
    o = gated_delta_rule_varlen(q, k, v, g, beta, out_state, md, True, chunk_size=chunk)
    qn, kn = _prepare(q, k, hv // hk)
    for i in range(len(LENS)):
        lo, hi = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        start = state[SLOTS[i]] if HAS_STATE[i] else torch.zeros(hv, dv, dk)
        ref_o, ref_state = _recurrent(qn[lo:hi], kn[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                      start)
        torch.testing.assert_close(o[lo:hi], ref_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_state[SLOTS[i]], ref_state, atol=1e-4, rtol=1e-4)


def test_varlen_gated_delta_rule_leaves_state_alone_without_write():
    torch.manual_seed(1)
    q, k, v, g, beta = _inputs(sum(LENS), 2, 2, 4, 4)
    state = torch.randn(5, 2, 4, 4)
    before = state.clone()
    gated_delta_rule_varlen(q, k, v, g, beta, state, step_metadata(), False)
    assert torch.equal(state, before)


def test_chunked_form_matches_the_recurrence_over_several_chunks():
    torch.manual_seed(2)
    b, length, h, dk, dv = 2, 96, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(b, length, h, dk), dim=-1)
            for _ in range(2))
    v, g = torch.randn(b, length, h, dv), -torch.rand(b, length, h)
    beta, init = torch.rand(b, length, h), torch.randn(b, h, dv, dk)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, init, 32)
    for r in range(b):
        ref_o, ref_state = _recurrent(q[r], k[r], v[r], g[r], beta[r], init[r])
        torch.testing.assert_close(o[r], ref_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[r], ref_state, atol=1e-4, rtol=1e-4)


def test_value_heads_must_be_a_multiple_of_key_heads():
    q, k, v, g, beta = _inputs(3, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        gated_delta_rule_varlen(q, k, v, g, beta, torch.zeros(5, 3, 4, 4), step_metadata(),
                                False)


def test_strong_decay_stays_finite():
    """Decays down to exp(-40) per token: a chunk's cumulative decay underflows to 0, which
    must read as "forgotten", never as inf / nan."""
    torch.manual_seed(3)
    b, length, h, dk, dv = 1, 64, 2, 4, 4
    q, k = (torch.nn.functional.normalize(torch.randn(b, length, h, dk), dim=-1)
            for _ in range(2))
    v, g = torch.randn(b, length, h, dv), -40 * torch.rand(b, length, h)
    beta, init = torch.rand(b, length, h), torch.randn(b, h, dv, dk)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, init, 64)
    ref_o, ref_state = _recurrent(q[0], k[0], v[0], g[0], beta[0], init[0])
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    torch.testing.assert_close(o[0], ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final[0], ref_state, atol=1e-4, rtol=1e-4)
