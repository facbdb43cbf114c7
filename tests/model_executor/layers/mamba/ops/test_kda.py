"""Kimi Delta Attention's rule (`ops/kda.py`: a per key channel decay) against a token-by-token
fp64 recurrence: on a varlen batch mixing fresh prefills, continued chunks and single-token
decodes with the states read from and written to their slots; the chunked form alone over
several chunks, chunks that are no multiple of the sub-block, and decays strong enough that
any positive exponent would overflow."""

import pytest
import torch

from minivllm.model_executor.layers.mamba.ops.kda import chunk_kda_rule, kda_varlen
from tests.model_executor.layers.mamba.ops._varlen_batch import (HAS_STATE, LENS, SLOTS,
                                                                 step_metadata)


def _recurrent(q, k, v, g, beta, state):
    """The rule one token at a time, in fp64: q / k / g [L, h, dk] (ready to use), v [L, h, dv],
    beta [L, h], state [h, dv, dk]."""
    q, k, v, g, beta, state = (x.double() for x in (q, k, v, g, beta, state))
    outs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, :]
        err = v[t] - torch.einsum("hvk,hk->hv", state, k[t])
        state = state + (err * beta[t][:, None])[:, :, None] * k[t][:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", state, q[t]))
    return torch.stack(outs), state


def _inputs(total, h, dk, dv, lower_bound=-5.0):
    q, k, v = torch.randn(total, h, dk), torch.randn(total, h, dk), torch.randn(total, h, dv)
    g = lower_bound * torch.sigmoid(torch.randn(total, h, dk))      # Ling's safe gate
    return q, k, v, g, torch.rand(total, h)


def _normalised(*shape):
    return torch.nn.functional.normalize(torch.randn(*shape), dim=-1)


@pytest.mark.parametrize("chunk", [64, 16])
def test_varlen_kda_matches_the_recurrence(chunk):
    torch.manual_seed(0)
    h, dk, dv = 3, 8, 6
    q, k, v, g, beta = _inputs(sum(LENS), h, dk, dv, lower_bound=-0.5)
    state = torch.randn(5, h, dv, dk)
    md = step_metadata()
    out_state = state.clone()
    o = kda_varlen(q, k, v, g, beta, out_state, md, True, chunk_size=chunk)
    qn = torch.nn.functional.normalize(q, dim=-1, eps=0) * dk ** -0.5
    kn = torch.nn.functional.normalize(k, dim=-1, eps=0)
    for i in range(len(LENS)):
        lo, hi = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        start = state[SLOTS[i]] if HAS_STATE[i] else torch.zeros(h, dv, dk)
        ref_o, ref_state = _recurrent(qn[lo:hi], kn[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                      start)
        torch.testing.assert_close(o[lo:hi].double(), ref_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_state[SLOTS[i]].double(), ref_state, atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("length, chunk", [(96, 32), (150, 50), (12, 12)],
                         ids=["sub_blocks", "chunk_not_a_multiple_of_16", "one_sub_block"])
def test_chunked_form_matches_the_recurrence(length, chunk):
    torch.manual_seed(2)
    b, h, dk, dv = 2, 3, 8, 5
    q, k = _normalised(b, length, h, dk), _normalised(b, length, h, dk)
    v, g = torch.randn(b, length, h, dv), -torch.rand(b, length, h, dk)
    beta, init = torch.rand(b, length, h), torch.randn(b, h, dv, dk)
    o, final = chunk_kda_rule(q, k, v, g, beta, init, chunk)
    for r in range(b):
        ref_o, ref_state = _recurrent(q[r], k[r], v[r], g[r], beta[r], init[r])
        torch.testing.assert_close(o[r].double(), ref_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[r].double(), ref_state, atol=1e-4, rtol=1e-4)


def test_strong_per_channel_decay_stays_finite():
    """Down to exp(-40) per token and channel, some channels barely decaying: a chunk's
    cumulative decays span thousands in log space (exp of any positive one would be inf)."""
    torch.manual_seed(3)
    b, length, h, dk, dv = 1, 128, 2, 8, 4
    q, k = _normalised(b, length, h, dk), _normalised(b, length, h, dk)
    g = -40 * torch.rand(b, length, h, dk)
    g[..., :2] = -1e-3 * torch.rand(b, length, h, 2)           # two long-memory channels
    v, beta, init = torch.randn(b, length, h, dv), torch.rand(b, length, h), torch.randn(b, h, dv, dk)
    o, final = chunk_kda_rule(q, k, v, g, beta, init, 64)
    ref_o, ref_state = _recurrent(q[0], k[0], v[0], g[0], beta[0], init[0])
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    torch.testing.assert_close(o[0].double(), ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final[0].double(), ref_state, atol=1e-4, rtol=1e-4)


def test_gate_must_be_per_key_channel():
    q, k, v, g, beta = _inputs(sum(LENS), 2, 4, 4)
    with pytest.raises(ValueError, match="one gate per key channel"):
        kda_varlen(q, k, v, g[..., 0], beta, torch.zeros(5, 2, 4, 4), step_metadata(), False)
