"""Lightning attention (vLLM's `layers/lightning_attn.py`): linear attention with a fixed
per-head decay, the core of MiniMax-Text-01's and Ling / Ring 2.5's linear-attention layers.

Per head, with the state S [d, e] (vLLM's layout: key dim first) and a log decay g_t <= 0
(g_t = -slope for lightning attention):

    S_t = exp(g_t) S_{t-1} + k_t^T v_t
    o_t = q_t S_t

Decode rows (one token) take that step once, all together. Longer rows run in chunks: inside a
chunk the outputs are a decayed causal `q k^T` product plus the entering state read through
q exp(cumsum g), all chunks at once; only the state hand-over between chunks is a loop (over
the chunks of the longest row, vectorised over rows and heads). vLLM's GPU kernels are Triton;
these are the same sums in torch, fp32 throughout. Every exponent is <= 0, so nothing
overflows however long a chunk is.
"""

import torch

from minivllm.model_executor.layers.mamba.ops.varlen_scan import scan_varlen
from minivllm.v1.attention.backends.linear_attn import LinearAttentionMetadata
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata

PAD_SLOT_ID = -1


def linear_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q / k [b, h, d], v [b, h, e], g [b, h], state [b, h, d, e].
    Returns o [b, h, e] and the new state."""
    state = state * torch.exp(g)[..., None, None] + k[..., :, None] * v[..., None, :]
    return torch.einsum("bhd,bhde->bhe", q, state), state


def chunk_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           init_state: torch.Tensor, chunk_size: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q / k [b, L, h, d], v [b, L, h, e], g [b, L, h], init_state [b, h, d, e]; L a multiple
    of chunk_size. Returns o [b, L, h, e] and the final state [b, h, d, e]."""
    b, length, h, _ = q.shape
    e, nc, c = v.shape[-1], length // chunk_size, chunk_size
    # -> [b, h, nc, c, d|e] and [b, h, nc, c]
    q, k, v = (x.view(b, nc, c, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    gam = torch.cumsum(g.view(b, nc, c, h).permute(0, 3, 1, 2), dim=-1)   # decay since start
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # decay[t, s] = exp(gam_t - gam_s) for s <= t, 0 above the diagonal (future tokens).
    decay = torch.exp((gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, -torch.inf))
    out = ((q @ k.transpose(-1, -2)) * decay) @ v                    # within-chunk [.., c, e]
    q_from_state = q * torch.exp(gam)[..., None]                      # reads S entering chunk
    # Each chunk's own writes, decayed to the chunk's end: [b, h, nc, d, e], all at once.
    chunk_kv = (k * torch.exp(gam[..., -1:] - gam)[..., None]).transpose(-1, -2) @ v
    chunk_decay = torch.exp(gam[..., -1])[..., None, None]            # [b, h, nc, 1, 1]
    state = init_state
    for i in range(nc):     # NOTE: the state hand-over between chunks, vectorised over b, h
        out[:, :, i] += q_from_state[:, :, i] @ state
        state = state * chunk_decay[:, :, i] + chunk_kv[:, :, i]
    return out.permute(0, 2, 3, 1, 4).reshape(b, length, h, e), state


def linear_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            slope_rate: torch.Tensor, state: torch.Tensor,
                            md: LinearAttentionMetadata | ShortConvAttentionMetadata,
                            write_state: bool,
                            chunk_size: int = 64) -> torch.Tensor:
    """Every sequence of a step (prefills, prefill chunks and decodes in any order).
    q / k [T, h, d], v [T, h, e], slope_rate [h] (or [h, 1, 1]); state [slots, h, d, e] is
    read (sequences with an initial state) and, when write_state, overwritten.
    Returns o [T, h, e] fp32."""
    num_tokens, num_heads = q.shape[:2]
    # The decay as a per-token log decay: the varlen frame pads rows with g = 0 (no decay), so
    # a padded row's final state is its state after its last real token.
    g = (-slope_rate.float().reshape(1, num_heads)).expand(num_tokens, num_heads).contiguous()
    return scan_varlen((q.float(), k.float(), v.float(), g), tuple(v.shape), state,
                       md, write_state, step=linear_attention_step,
                       chunk_scan=chunk_linear_attention, chunk_size=chunk_size)


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                        block_size: int = 256, kv_history: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's prefill entry point: q / k [b, h, n, d], v [b, h, n, e], ed [h] (the slopes),
    kv_history [b, h, d, e] or None (zero). Returns o [b, h, n, e] fp32 and the final state
    [b, h, d, e] (vLLM's kernel returns it with an extra block axis; its callers keep the last)."""
    b, h, n, d = q.shape
    chunk = min(block_size, n)
    padded = -(-n // chunk) * chunk
    g = (-ed.float().reshape(1, 1, h)).expand(b, n, h)

    def pad(x: torch.Tensor) -> torch.Tensor:        # [b, n, h, ...] -> [b, padded, h, ...]
        return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, padded - n))
    q_, k_, v_ = (pad(x.float().transpose(1, 2)) for x in (q, k, v))
    init = (torch.zeros(b, h, d, v.shape[-1], dtype=torch.float32, device=q.device)
            if kv_history is None else kv_history.float())
    out, state = chunk_linear_attention(q_, k_, v_, pad(g), init, chunk)
    return out[:, :n].transpose(1, 2), state


def linear_decode_forward_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 kv_caches: torch.Tensor, slope_rate: torch.Tensor,
                                 slot_idx: torch.Tensor, BLOCK_SIZE: int = 32) -> torch.Tensor:
    """vLLM's decode entry point (the name kept; torch here): q / k / v [B, H, 1, D],
    kv_caches [slots, H, D, D] updated in place at slot_idx [B] (PAD_SLOT_ID rows skipped).
    Returns o [B, H * D] in q's dtype."""
    batch, heads, _, dim = q.shape
    valid = slot_idx != PAD_SLOT_ID
    slots = slot_idx[valid].long()
    g = (-slope_rate.float().reshape(1, heads)).expand(int(valid.sum()), heads)
    out = q.new_zeros(batch, heads, dim, dtype=torch.float32)
    out[valid], new_state = linear_attention_step(
        q[valid, :, 0].float(), k[valid, :, 0].float(), v[valid, :, 0].float(), g,
        kv_caches.index_select(0, slots).float())
    kv_caches.index_copy_(0, slots, new_state.to(kv_caches.dtype))
    return out.reshape(batch, heads * dim).to(q.dtype)
