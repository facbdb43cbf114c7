"""Kimi Delta Attention's rule: the gated delta rule with a per key channel decay, in fp32.

Per head, with the state S [dv, dk] (vLLM's layout), a log decay g_t [dk] <= 0 (one forget
rate per key channel instead of Gated DeltaNet's one per head) and a write strength beta_t:

    S_t = S_{t-1} diag(exp(g_t)) + beta_t (v_t - S_{t-1} diag(exp(g_t)) k_t) k_t^T
    o_t = S_t q_t                                  q, k L2-normalised, q scaled by dk^-1/2

Decode rows take that update once; longer rows run in chunks (`varlen_scan.py`) condensed by
the WY / UT transform as `gated_delta_rule.py` does. The chunk's pair decays
exp(G_t - G_s) (G the cumulative log decay since the chunk start) now differ per channel, so
they cannot factor as one [c, c] matrix. Splitting exp(G_t - G_s) = exp(G_t - R) exp(R - G_s)
at a boundary R with s <= R-position <= t keeps both factors <= 1 (nothing can overflow
whatever the gate): pairs in different sub-blocks of `SUB` tokens take R = G at the end of
the sub-block before t's and become a matmul; pairs inside one sub-block use exp(G_t - G_s)
directly ([SUB, SUB, dk] per sub-block).
"""

import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.mamba.ops.gated_delta_rule import prepare_qk
from minivllm.model_executor.layers.mamba.ops.varlen_scan import scan_varlen
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata

# Tokens per sub-block of a chunk. Per token, the direct pairs cost SUB dk and the cross-block
# decayed keys c dk / SUB: 8 balances them for chunks of 64.
SUB = 8


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q / k / g [b, h, dk] (q, k normalised and scaled), v [b, h, dv],
    beta [b, h], state [b, h, dv, dk]. Returns o [b, h, dv] and the new state. fp32."""
    state = state * torch.exp(g)[..., None, :]                        # decay along dk
    predicted = torch.einsum("bhvk,bhk->bhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + delta[..., :, None] * k[..., None, :]
    return torch.einsum("bhvk,bhk->bhv", state, q), state


def chunk_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, init_state: torch.Tensor, chunk_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q / k / g [b, L, h, dk] (q, k normalised and scaled), v [b, L, h, dv], beta [b, L, h],
    init_state [b, h, dv, dk]; L a multiple of chunk_size. Returns o [b, L, h, dv] and the
    final state [b, h, dv, dk]. fp32."""
    b, length, h, dk = k.shape
    dv, nc, c = v.shape[-1], length // chunk_size, chunk_size
    # -> [b, h, nc, c, d] and [b, h, nc, c]
    # Contiguous once here, or every matmul below would copy its operands.
    q, k, v, g = (x.view(b, nc, c, h, -1).permute(0, 3, 1, 2, 4).contiguous()
                  for x in (q, k, v, g))
    beta = beta.view(b, nc, c, h).permute(0, 3, 1, 2)
    pad = -c % SUB if c > SUB else 0
    if pad:     # zero tokens at a chunk's end: no decay, no write, outputs dropped below
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    gam = torch.cumsum(g, dim=-2)                       # [b, h, nc, c', dk], decreasing
    k_beta = k * beta[..., None]
    # (I + A) U = rhs with A[t, s] = beta_t sum_d k_t k_s exp(G_t - G_s), s < t (see above).
    system, attn = _decayed_products((k_beta, q), k, gam)             # [b, h, nc, c', c'] each
    # The unit diagonal replaces s = t (the products there are not part of A).
    system = system.tril(-1) + torch.eye(system.shape[-1], device=q.device)
    u_from_v, u_per_state = torch.linalg.solve_triangular(
        system, torch.cat([v * beta[..., None], k_beta * torch.exp(gam)], dim=-1),
        upper=False, unitriangular=True).split([dv, dk], dim=-1)      # [.., c', dv], [.., c', dk]
    q_decayed = q * torch.exp(gam)                                    # reads S entering chunk
    k_to_end = k * torch.exp(gam[..., -1:, :] - gam)                  # writes, decayed to end
    chunk_decay = torch.exp(gam[..., -1, :])[..., :, None]            # [b, h, nc, dk, 1]
    state = init_state.transpose(-1, -2)                              # [b, h, dk, dv]
    out = v.new_empty(b, h, nc, gam.shape[-2], dv)
    for i in range(nc):     # NOTE: the state hand-over between chunks, vectorised over b, h
        u = u_from_v[:, :, i] - u_per_state[:, :, i] @ state          # [b, h, c', dv]
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = out[:, :, :, :c].permute(0, 2, 3, 1, 4).reshape(b, length, h, dv)
    return out, state.transpose(-1, -2)


def kda_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, md: ShortConvAttentionMetadata,
               write_state: bool, use_qk_l2norm: bool = True, scale: float | None = None,
               chunk_size: int = 64) -> torch.Tensor:
    """Every sequence of a step. q / k [T, h, dk], v [T, h, dv], g [T, h, dk] (log decay),
    beta [T, h]; state [slots, h, dv, dk] is read (sequences with an initial state) and, when
    write_state, overwritten. Returns o [T, h, dv] fp32."""
    if g.shape != k.shape or v.shape[1] != k.shape[1]:
        raise ValueError(f"KDA takes one gate per key channel and as many key as value heads: "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}")
    q, k = prepare_qk(q, k, v.shape[1], use_qk_l2norm, scale)
    return scan_varlen((q, k, v.float(), g.float(), beta.float()), v.shape, state, md,
                       write_state, step=kda_step, chunk_scan=chunk_kda_rule,
                       chunk_size=chunk_size)


def kda_gate(g: torch.Tensor, A: torch.Tensor, head_k_dim: int,
             g_bias: torch.Tensor | None = None, beta: float = 1.0, threshold: float = 20.0,
             lower_bound: float | None = None) -> torch.Tensor:
    """The per-channel log decay from the forget projection (FLA's `fused_kda_gate`):
    g [..., H*K] -> fp32 [..., H, K]. With a lower bound (the "safe gate"):
    lower_bound * sigmoid(exp(A) (g + bias)), in (lower_bound, 0); without:
    -exp(A) softplus(g + bias). A [H] or [1, 1, H, 1] (log rates per head)."""
    num_heads = A.numel()
    x = g.float().unflatten(-1, (num_heads, head_k_dim))
    if g_bias is not None:
        x = x + g_bias.float().view(num_heads, head_k_dim)
    rate = torch.exp(A.float()).view(num_heads, 1)                    # [H, 1]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x, beta=beta, threshold=threshold)


def _decayed_products(xs: tuple[torch.Tensor, ...], y: torch.Tensor, gam: torch.Tensor
                      ) -> list[torch.Tensor]:
    """For each x of xs: P[t, s] = sum_d x_t y_s exp(G_t - G_s) for s <= t, else 0.
    x / y / gam [.., c, dk] -> [.., c, c]; every exponent taken is <= 0. The decayed y is
    built once for all xs (the rule needs k_beta k^T and q k^T)."""
    *lead, c, dk = y.shape
    sub = min(SUB, c)
    n = c // sub
    gb, yb = gam.view(*lead, n, sub, dk), y.view(*lead, n, sub, dk)
    # Block boundaries: `end` is G at each sub-block's last token, `ref` the one before each
    # sub-block (0 before the first).
    end = gb[..., -1, :]                                              # [.., n, dk]
    ref = torch.cat([torch.zeros_like(end[..., :1, :]), end[..., :-1, :]], dim=-2)
    left = torch.exp(gb - ref[..., None, :])                          # [.., n, sub, dk], <= 1
    # Key s of block j < i, seen from query block i: exp(R_i - G_s) =
    # exp(R_i - E_j) exp(E_j - G_s), both factors <= 1, so only the [n, n, dk] block-to-block
    # decays and the per-token exp(E_j - G_s) need an exp.
    y_end = (yb * torch.exp(end[..., None, :] - gb)).transpose(-1, -2)  # [.., n, dk, sub]
    later = torch.ones(n, n, dtype=torch.bool, device=y.device).tril(-1)   # j < i
    between = _masked_exp(ref[..., :, None, :] - end[..., None, :, :], ~later[..., None])
    # -> [.., n_i, dk, n_j, sub] = [.., n, dk, c], contiguous as the matmul wants it
    y_right = (between.transpose(-1, -2)[..., None] * y_end.movedim(-3, -2)[..., None, :, :, :]
               ).view(*lead, n, dk, c)
    # Pairs inside one sub-block, directly: y_s exp(G_t - G_s) [.., n, sub(t), sub(s), dk].
    keep = torch.ones(sub, sub, dtype=torch.bool, device=y.device).tril()
    y_inner = yb[..., None, :, :] * _masked_exp(gb[..., :, None, :] - gb[..., None, :, :],
                                                ~keep[..., None])
    out = []
    for x in xs:
        xb = x.view(*lead, n, sub, dk)
        cross = (xb * left) @ y_right                                 # [.., n, sub, c]
        inner = (y_inner @ xb[..., None]).squeeze(-1)                 # [.., n, sub, sub]
        # The inner pairs onto the block diagonal ([.., sub, sub, n] view), where the cross
        # form gave 0.
        cross.view(*lead, n, sub, n, sub).diagonal(0, -4, -2).add_(inner.movedim(-3, -1))
        out.append(cross.view(*lead, c, c))
    return out


def _masked_exp(exponent: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """exp(exponent) with 0 where `drop` (whose exponents may be positive: clamped, never
    overflowing). Floored at -80 so that exp never makes a subnormal float (an arithmetic
    slow path on CPUs; what the floor changes, < e^-80, is far below fp32 rounding); no -inf
    goes in, which is a slow path of the vectorised exp."""
    return torch.exp(exponent.clamp_(-80.0, 0.0)).masked_fill_(drop, 0.0)
