"""The chunked SSD scan (`ops/ssd.py`) against the step-by-step recurrence on a batch mixing
fresh prefills, continued chunks and single-token decodes, with the per-sequence states read
from and written back to their slots."""

import torch

from minivllm.model_executor.layers.mamba.ops.ssd import mamba_chunk_scan_varlen
from tests.model_executor.layers.mamba.ops._varlen_batch import (HAS_STATE, LENS, SLOTS,
                                                                 step_metadata)


def _recurrent(x, dt, a, b, c, state):
    """h_t = exp(dt A) h_{t-1} + dt x_t B_t^T;  y_t = h_t C_t  (x [L, h, p], b / c [L, h, n])."""
    ys = []
    for t in range(x.shape[0]):
        state = (state * torch.exp(dt[t] * a)[:, None, None]
                 + (x[t] * dt[t][:, None])[..., None] * b[t][:, None, :])
        ys.append(torch.einsum("hpn,hn->hp", state, c[t]))
    return torch.stack(ys), state


def test_chunked_scan_matches_the_recurrence():
    torch.manual_seed(0)
    h, p, n, total = 4, 3, 5, sum(LENS)
    x, dt = torch.randn(total, h, p), torch.rand(total, h)
    a = -torch.rand(h) * 2
    b, c = torch.randn(total, h, n), torch.randn(total, h, n)
    state = torch.randn(5, h, p, n)
    md = step_metadata()
    out_state = state.clone()
    y = mamba_chunk_scan_varlen(x, dt, a, b, c, out_state, md, True, chunk_size=16)
    for i in range(len(LENS)):
        lo, hi = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        start = state[SLOTS[i]] if HAS_STATE[i] else torch.zeros(h, p, n)
        ref_y, ref_state = _recurrent(x[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], start)
        torch.testing.assert_close(y[lo:hi], ref_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_state[SLOTS[i]], ref_state, atol=1e-4, rtol=1e-4)
