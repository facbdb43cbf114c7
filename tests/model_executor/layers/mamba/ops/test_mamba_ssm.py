"""Mamba-1's selective scan (`ops/mamba_ssm.py`) against the step-by-step recurrence on a batch
mixing fresh prefills, continued chunks and single-token decodes, with the per-sequence states
read from and written back to their slots; and the doubling scan on its own."""

import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.mamba.ops.mamba_ssm import (linear_scan,
                                                                selective_scan_varlen)
from tests.model_executor.layers.mamba.ops._varlen_batch import (HAS_STATE, LENS, SLOTS,
                                                                 step_metadata)


def _recurrent(x, dt, a, b, c, d, z, state):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t;  y_t = (h_t C_t + D x_t) silu(z_t)
    (x / dt / z [L, D], a [D, N], b / c [L, N], state [D, N])."""
    ys = []
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t][:, None] * a) + (dt[t] * x[t])[:, None] * b[t]
        ys.append((state @ c[t] + d * x[t]) * F.silu(z[t]))
    return torch.stack(ys), state


def test_linear_scan_matches_the_loop():
    torch.manual_seed(0)
    a, b = torch.rand(2, 37, 3), torch.randn(2, 37, 3)
    h, cum = linear_scan(a, b, dim=1)
    ref_h, ref_cum = torch.zeros(2, 3), torch.ones(2, 3)
    for t in range(37):
        ref_h, ref_cum = a[:, t] * ref_h + b[:, t], ref_cum * a[:, t]
        torch.testing.assert_close(h[:, t], ref_h)
        torch.testing.assert_close(cum[:, t], ref_cum)


def test_selective_scan_matches_the_recurrence():
    torch.manual_seed(0)
    dim, n, total = 6, 4, sum(LENS)
    x, dt, z = torch.randn(total, dim), torch.rand(total, dim), torch.randn(total, dim)
    a, d = -torch.rand(dim, n) * 4, torch.randn(dim)
    b, c = torch.randn(total, n), torch.randn(total, n)
    state = torch.randn(5, dim, n)
    md = step_metadata()
    out_state = state.clone()
    # Chunks of 16 over the 130-token prompt: 9 chunks, the last one partly padding.
    y = selective_scan_varlen(x, dt, a, b, c, d, z, out_state, md, True, chunk_size=16)
    for i in range(len(LENS)):
        lo, hi = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        start = state[SLOTS[i]] if HAS_STATE[i] else torch.zeros(dim, n)
        ref_y, ref_state = _recurrent(x[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], d, z[lo:hi],
                                      start)
        torch.testing.assert_close(y[lo:hi], ref_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_state[SLOTS[i]], ref_state, atol=1e-4, rtol=1e-4)


def test_selective_scan_without_state_writes_leaves_slots_alone():
    torch.manual_seed(1)
    dim, n, total = 3, 2, sum(LENS)
    state = torch.randn(5, dim, n)
    before = state.clone()
    selective_scan_varlen(torch.randn(total, dim), torch.rand(total, dim), -torch.rand(dim, n),
                          torch.randn(total, n), torch.randn(total, n), torch.ones(dim),
                          torch.randn(total, dim), state, step_metadata(), False)
    assert torch.equal(state, before)
