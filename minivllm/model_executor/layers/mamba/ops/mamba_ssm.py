"""Mamba-1's selective scan over a step's sequences, in fp32.

Per channel d (of D) and state entry n (of N), with a decay in (0, 1]:

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] x_t[d]
    y_t[d]    = (sum_n h_t[d, n] C_t[n] + D[d] x_t[d]) * silu(z_t[d])

The decay differs per (channel, state entry), so Mamba-2's chunked matrix form does not apply.
The recurrence h_t = a_t h_{t-1} + b_t is associative instead: decode rows (one token) take one
step; longer rows are padded to [r, L] (padding has dt = 0: decay 1, no input, so a row's last
state is its state after its last token) and scanned by doubling inside chunks of `chunk_size`
tokens, then across the chunks' end states. Only products of decays <= 1 are formed, so
nothing overflows; nothing loops over tokens or sequences (log2 of the chunk and chunk-count
steps).
"""

import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.mamba.ops.varlen_scan import scan_varlen
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


def linear_scan(a: torch.Tensor, b: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of h_t = a_t h_{t-1} + b_t from h_{-1} = 0 along `dim` (Hillis-Steele
    doubling). Returns (h, cumulative decay prod_{s<=t} a_s), both shaped like a / b."""
    length = a.shape[dim]
    step = 1
    while step < length:       # NOTE: log2(length) doubling rounds, not a token loop
        a_prev, b_prev = a.narrow(dim, 0, length - step), b.narrow(dim, 0, length - step)
        a_cur, b_cur = a.narrow(dim, step, length - step), b.narrow(dim, step, length - step)
        b = torch.cat([b.narrow(dim, 0, step), torch.addcmul(b_cur, a_cur, b_prev)], dim=dim)
        a = torch.cat([a.narrow(dim, 0, step), a_cur * a_prev], dim=dim)
        step *= 2
    return b, a


def selective_scan_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, init_state: torch.Tensor,
                           chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x / dt [r, L, D], A [D, N], B / C [r, L, N], init_state [r, D, N]; L a multiple of
    chunk_size. Returns y [r, L, D] (without the D skip and gate) and the final state."""
    r, length, dim = x.shape
    nc, c = length // chunk_size, chunk_size
    decay = torch.exp(dt[..., None] * A).view(r, nc, c, dim, -1)        # [r, nc, c, D, N]
    inp = ((dt * x)[..., None] * B[:, :, None, :]).view(r, nc, c, dim, -1)
    h_local, decay_cum = linear_scan(decay, inp, dim=2)                  # from 0 per chunk
    # The state entering chunk k: chunk ends scanned across chunks, from init_state.
    end_decay, end_h = decay_cum[:, :, -1], h_local[:, :, -1]            # [r, nc, D, N]
    end_h = torch.cat([init_state[:, None], end_h], dim=1)               # [r, nc + 1, D, N]
    end_decay = F.pad(end_decay, (0, 0, 0, 0, 1, 0), value=1.0)
    entering, _ = linear_scan(end_decay, end_h, dim=1)
    h = torch.addcmul(h_local, decay_cum, entering[:, :-1, None])        # [r, nc, c, D, N]
    y = torch.einsum("rkcdn,rkcn->rkcd", h, C.view(r, nc, c, -1))
    return y.reshape(r, length, dim), h[:, -1, -1]


def selective_state_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         C: torch.Tensor, state: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x / dt [b, D], B / C [b, N], state [b, D, N].
    Returns y [b, D] (without the D skip and gate) and the new state."""
    state = torch.addcmul(torch.exp(dt[..., None] * A) * state, (dt * x)[..., None],
                          B[:, None, :])
    return torch.einsum("bdn,bn->bd", state, C), state


def selective_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                          B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, z: torch.Tensor,
                          ssm_state: torch.Tensor, md: ShortConvAttentionMetadata,
                          write_state: bool, chunk_size: int = 16) -> torch.Tensor:
    """Every sequence of a step. x / dt / z [T, D] (dt after its bias and softplus), A [D, N],
    B / C [T, N], D [D], all fp32; ssm_state [slots, D, N] is read (sequences with an initial
    state) and, when write_state, overwritten. Returns y [T, D] fp32, gated by silu(z)."""
    y = scan_varlen(
        (x, dt, B, C), x.shape, ssm_state, md, write_state,
        step=lambda x, dt, b, c, init: selective_state_step(x, dt, A, b, c, init),
        chunk_scan=lambda x, dt, b, c, init, chunk: selective_scan_chunked(x, dt, A, b, c, init,
                                                                          chunk),
        chunk_size=chunk_size)
    return (y + x * D) * F.silu(z)
