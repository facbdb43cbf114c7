"""Qwen's gated-attention input step in one call (vLLM's `fused_qk_norm_rope`): split q from its
output gate, RMS-normalise every q / k head, rotate the first rotary_dim features (NeoX
halves; multimodal positions pick T / H / W per frequency, interleaved), copy the gate.

vLLM runs it as one GPU kernel; here it is a few vectorised tensor ops with the same rounding
points (the normalised head is rounded to the input dtype before the rotation).
"""

import torch

from minivllm.model_executor.layers.rotary_embedding.mrope import mrope_axis_of_frequency


def _rms_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, norm_beta: float,
               dtype: torch.dtype) -> torch.Tensor:
    """x [T, heads, d] -> normalised, times (weight + norm_beta), rounded to dtype, as fp32."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * (weight.float() + norm_beta)).to(dtype).float()


def _cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor,
             mrope_section: list[int] | tuple[int, int, int] | None, half: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [T, 1, half] of each token's position. 2D positions [3, T]: frequency i
    takes H when i % 3 == 1 and i < 3 * sections[1], W when i % 3 == 2 and i < 3 * sections[2],
    else T (the interleaved multimodal layout)."""
    if positions.dim() == 1:
        rows = cos_sin_cache.index_select(0, positions.long()).float()      # [T, rotary_dim]
        return rows[:, None, :half], rows[:, None, half:2 * half]
    axis = mrope_axis_of_frequency(list(mrope_section), interleaved=True)
    pos = positions.long()[axis.to(positions.device)].t()                   # [T, half]
    cos = cos_sin_cache[:, :half].float().gather(0, pos)
    sin = cos_sin_cache[:, half:2 * half].float().gather(0, pos)
    return cos[:, None], sin[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
            ) -> torch.Tensor:
    """NeoX rotation of x[..., :rotary_dim] (fp32 [T, heads, d]); the tail passes through."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def fused_qk_rmsnorm_rope_gate(
        q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor, positions: torch.Tensor, eps: float, num_q_heads: int,
        num_kv_heads: int, head_dim: int, rotary_dim: int,
        mrope_section: list[int] | tuple[int, int, int] | None = None,
        norm_beta: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_gate [T, num_q_heads * 2 * head_dim] (per head [q | gate]), k [T, num_kv_heads *
    head_dim], weights [head_dim], cos_sin_cache [max_pos, rotary_dim] ([cos | sin]),
    positions [T] or [3, T]. Returns (q, k, gate), each [T, heads * head_dim] in q_gate's
    dtype; the gate is the raw (pre-sigmoid) one."""
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even integer <= head_dim, got "
                         f"rotary_dim={rotary_dim}, head_dim={head_dim}")
    if positions.dim() not in (1, 2) or positions.shape[-1] != q_gate.shape[0]:
        raise ValueError(f"positions must be [T] or [3, T] with T={q_gate.shape[0]}, got "
                         f"{tuple(positions.shape)}")
    if positions.dim() == 2 and (positions.shape[0] != 3 or mrope_section is None
                                 or len(mrope_section) != 3
                                 or sum(mrope_section) != rotary_dim // 2):
        raise ValueError(f"[3, T] positions need 3 mrope_section counts summing to "
                         f"rotary_dim // 2 = {rotary_dim // 2}, got {mrope_section}")
    if positions.dim() == 1 and mrope_section is not None:
        raise ValueError("mrope_section requires [3, T] positions")
    num_tokens, dtype = q_gate.shape[0], q_gate.dtype
    q, gate = q_gate.view(num_tokens, num_q_heads, 2 * head_dim).chunk(2, dim=-1)
    q = _rms_heads(q, q_weight, eps, norm_beta, dtype)                  # [T, hq, d] fp32
    k = _rms_heads(k.view(num_tokens, num_kv_heads, head_dim), k_weight, eps, norm_beta, dtype)
    cos, sin = _cos_sin(cos_sin_cache, positions, mrope_section, rotary_dim // 2)
    q_out = _rotate(q, cos, sin, rotary_dim).to(dtype).reshape(num_tokens, -1)
    k_out = _rotate(k, cos, sin, rotary_dim).to(dtype).reshape(num_tokens, -1)
    return q_out, k_out, gate.reshape(num_tokens, -1).contiguous()
