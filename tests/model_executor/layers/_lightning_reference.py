"""The plain fp64 token-by-token lightning-attention recurrence the linear-attention tests
check against: S_t = exp(-slope) S_{t-1} + k_t^T v_t, o_t = q_t S_t."""

import torch

SLOPES = torch.tensor([0.9, 0.25, 0.01, 1e-5])     # fast to barely-forgetting heads


def recurrence_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q / k / v [n, h, d] of one sequence, state [h, d, e] -> o [n, h, e], final state."""
    decay = torch.exp(-slopes.double().flatten())[:, None, None]
    s, outs = state.double(), []
    for t in range(q.shape[0]):
        s = decay * s + k[t].double()[:, :, None] * v[t].double()[:, None, :]
        outs.append(torch.einsum("hd,hde->he", q[t].double(), s))
    return torch.stack(outs), s


def qkv(n: int, h: int = 4, d: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random q, k, v [n, h, d] (small, so long runs stay well scaled)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, d, generator=gen) * 0.3 for _ in range(3))
