"""Mamba-2's selective state-space scan (SSD) over a step's sequences, in fp32.

Per head h (P channels, N state entries), with a = dt * A[h] <= 0:

    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T        S [P, N]
    y_t = S_t C_t + D[h] x_t

Decode rows (one token) take that recurrence once. Longer rows are padded into [b, L] (padding
has dt = 0: no decay, no input; `varlen_scan.py` lays the step out) and scanned in chunks of `chunk_size`: inside a chunk y is a masked [c, c] attention-like product;
chunk states are carried across chunks through one [nc + 1, nc + 1] decay matrix. Nothing loops
over tokens, sequences or chunks.
"""

import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.mamba.ops.varlen_scan import scan_varlen
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., n] -> [..., n, n]: out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above."""
    n = a.shape[-1]
    cum = torch.cumsum(a, dim=-1)
    out = cum[..., :, None] - cum[..., None, :]
    keep = torch.ones(n, n, dtype=torch.bool, device=a.device).tril()
    return out.masked_fill(~keep, float("-inf"))


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, init_state: torch.Tensor, chunk_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, L, h, p], dt [b, L, h], A [h], B / C [b, L, h, n] (groups already expanded to
    heads), init_state [b, h, p, n]; L a multiple of chunk_size. All fp32.
    Returns y [b, L, h, p] (without the D skip) and the final state [b, h, p, n]."""
    b, length, h, p = x.shape
    nc, c = length // chunk_size, chunk_size
    x, dt = x.view(b, nc, c, h, p), dt.view(b, nc, c, h)
    B, C = B.view(b, nc, c, h, -1), C.view(b, nc, c, h, -1)
    a = (dt * A).permute(0, 3, 1, 2)                                   # [b, h, nc, c]
    a_cum = torch.cumsum(a, dim=-1)
    xdt = x * dt[..., None]                                            # [b, nc, c, h, p]
    # Inside each chunk: y[t] = sum_{s<=t} (C_t . B_s) exp(a_s+1 + ... + a_t) xdt_s.
    decay = torch.exp(_segsum(a))                                      # [b, h, nc, c, c]
    scores = torch.einsum("bkthn,bkshn->bhkts", C, B) * decay
    y = torch.einsum("bhkts,bkshp->bkthp", scores, xdt)
    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                        # [b, h, nc, c]
    chunk_states = torch.einsum("bkshn,bhks,bkshp->bkhpn", B, to_end, xdt)
    # State entering chunk k: the initial state and chunks < k, each decayed to chunk k.
    states = torch.cat([init_state[:, None], chunk_states], dim=1)     # [b, nc+1, h, p, n]
    chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))   # [b, h, nc+1, nc+1]
    states = torch.einsum("bhzk,bkhpn->bzhpn", chunk_decay, states)
    entering, final = states[:, :-1], states[:, -1]
    y = y + torch.einsum("bkthn,bkhpn,bhkt->bkthp", C, entering, torch.exp(a_cum))
    return y.reshape(b, length, h, p), final


def ssd_decode_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [b, h, p], dt [b, h], B / C [b, h, n], state [b, h, p, n].
    Returns y [b, h, p] (without the D skip) and the new state. All fp32."""
    state = state * torch.exp(dt * A)[..., None, None] + \
        (x * dt[..., None])[..., None] * B[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", state, C), state


def mamba_chunk_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                            B: torch.Tensor, C: torch.Tensor, ssm_state: torch.Tensor,
                            md: ShortConvAttentionMetadata, write_state: bool,
                            chunk_size: int = 64) -> torch.Tensor:
    """The scan of every sequence of a step. x [T, h, p], dt [T, h] (after softplus and
    clamping), B / C [T, h, n] fp32; ssm_state [slots, h, p, n] is read (sequences with an
    initial state) and, when write_state, overwritten. Returns y [T, h, p] fp32."""
    return scan_varlen(
        (x, dt, B, C), x.shape, ssm_state, md, write_state,
        step=lambda x, dt, b, c, init: ssd_decode_step(x, dt, A, b, c, init),
        chunk_scan=lambda x, dt, b, c, init, chunk: ssd_chunk_scan(x, dt, A, b, c, init, chunk),
        chunk_size=chunk_size)
