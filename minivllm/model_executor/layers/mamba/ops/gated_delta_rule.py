"""The gated delta rule (Gated DeltaNet's linear attention) over a step's sequences, in fp32.

Per value head, with the state S [dv, dk] (vLLM's layout of the recurrent state), a decay
g_t <= 0 (log space) and a write strength beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + beta_t (v_t - exp(g_t) S_{t-1} k_t) k_t^T
    o_t = S_t q_t                                  q, k L2-normalised, q scaled by dk^-1/2

Decode rows (one token) take that update once. Longer rows are padded into [r, L] and run in
chunks of `chunk_size` (64): inside a chunk the c sequential delta updates are condensed by the
WY / UT transform (one unit-lower-triangular solve per chunk, all chunks at once), so only the
hand-over of the state between chunks is sequential: a loop over the chunks of the longest row,
vectorised over rows and heads. Padding has g = beta = 0 and zero q / k / v, which leaves the
state untouched, so a padded row's final state is the one after its last real token.
"""

import torch

from minivllm.model_executor.layers.mamba.ops.varlen_scan import scan_varlen
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q / k [b, h, dk] (normalised and scaled), v [b, h, dv],
    g / beta [b, h], state [b, h, dv, dk]. Returns o [b, h, dv] and the new state. fp32."""
    state = state * torch.exp(g)[..., None, None]
    predicted = torch.einsum("bhvk,bhk->bhv", state, k)               # what S already says
    delta = (v - predicted) * beta[..., None]
    state = state + delta[..., :, None] * k[..., None, :]
    return torch.einsum("bhvk,bhk->bhv", state, q), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, init_state: torch.Tensor, chunk_size: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q / k [b, L, h, dk] (normalised and scaled), v [b, L, h, dv], g / beta [b, L, h],
    init_state [b, h, dv, dk]; L a multiple of chunk_size. All fp32.
    Returns o [b, L, h, dv] and the final state [b, h, dv, dk]."""
    b, length, h, dk = k.shape
    dv, nc, c = v.shape[-1], length // chunk_size, chunk_size
    # -> [b, h, nc, c, d] and [b, h, nc, c]
    q, k, v = (x.view(b, nc, c, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.view(b, nc, c, h).permute(0, 3, 1, 2) for x in (g, beta))
    gam = torch.cumsum(g, dim=-1)                                      # decay since chunk start
    # decay[t, s] = exp(gam_t - gam_s) for s <= t (0 above: those entries are never read)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, -torch.inf))
    k_beta = k * beta[..., None]
    # Token t's write u_t = beta_t (v_t - S_before_t k_t) depends on the earlier writes of the
    # chunk through A[t, s] = beta_t exp(gam_t - gam_s) k_t.k_s (s < t): (I + A) U = rhs.
    system = (k_beta @ k.transpose(-1, -2)) * decay                    # [b, h, nc, c, c]
    system = system.masked_fill(~causal.tril(-1), 0) + torch.eye(c, device=q.device)
    # U = (I + A)^-1 (beta V) - (I + A)^-1 (beta exp(gam) K) S_in: both solves, every chunk.
    u_from_v, u_per_state = torch.linalg.solve_triangular(
        system, torch.cat([v * beta[..., None], k_beta * torch.exp(gam)[..., None]], dim=-1),
        upper=False, unitriangular=True).split([dv, dk], dim=-1)      # [.., c, dv], [.., c, dk]
    attn = (q @ k.transpose(-1, -2)) * decay                           # [b, h, nc, c, c]
    q_decayed = q * torch.exp(gam)[..., None]                          # reads S entering chunk
    k_to_end = k * torch.exp(gam[..., -1:] - gam)[..., None]           # writes, decayed to end
    chunk_decay = torch.exp(gam[..., -1])[..., None, None]             # [b, h, nc, 1, 1]
    state = init_state.transpose(-1, -2)                               # [b, h, dk, dv]
    out = v.new_empty(b, h, nc, c, dv)
    for i in range(nc):     # NOTE: the state hand-over between chunks, vectorised over b, h
        u = u_from_v[:, :, i] - u_per_state[:, :, i] @ state           # [b, h, c, dv]
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = out.permute(0, 2, 3, 1, 4).reshape(b, length, h, dv)
    return out, state.transpose(-1, -2)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q / k [T, hk, dk] -> fp32 [T, hv, dk]: grouped heads expanded (key head j serves value
    heads j * hv / hk ..), L2-normalised when asked, q scaled (default dk^-1/2)."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    rep = num_v_heads // k.shape[1]
    if rep != 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q * (scale if scale is not None else k.shape[-1] ** -0.5), k


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor,
                            md: ShortConvAttentionMetadata, write_state: bool,
                            use_qk_l2norm: bool = True, scale: float | None = None,
                            chunk_size: int = 64) -> torch.Tensor:
    """Every sequence of a step. q / k [T, hk, dk], v [T, hv, dv] (hk divides hv), g / beta
    [T, hv]; state [slots, hv, dv, dk] is read (sequences with an initial state) and, when
    write_state, overwritten. Returns o [T, hv, dv] fp32."""
    num_v_heads = v.shape[1]
    if num_v_heads % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key heads cannot serve {num_v_heads} value heads: "
                         f"the value heads must be a multiple of the key heads")
    q, k = prepare_qk(q, k, num_v_heads, use_qk_l2norm, scale)
    return scan_varlen(
        (q, k, v.float(), g.float(), beta.float()), v.shape, state, md, write_state,
        step=gated_delta_rule_step, chunk_scan=chunk_gated_delta_rule, chunk_size=chunk_size)
