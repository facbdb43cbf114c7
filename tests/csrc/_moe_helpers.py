"""Operands of the native MoE kernel tests: stacked expert weights and routed tokens."""

import importlib

import torch

fused_moe_py = importlib.import_module("minivllm.model_executor.layers.fused_moe.fused_moe")

E, H, I = 8, 128, 64   # experts, hidden size, intermediate size


def expert_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 w1 [E, 2I, H] (gate rows, then up) and w2 [E, H, I]."""
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * I, H, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen) * 0.1).bfloat16()
    return w1, w2


def routed_tokens(num_tokens: int, k: int, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 x [T, H] and its renormalised top-k routing (weights, ids) from random logits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen).bfloat16()
    logits = torch.randn(num_tokens, E, generator=gen)
    w, ids, _ = fused_moe_py.fused_topk(x, logits, k, True)
    return x, w, ids


def rounded_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """The experts in fp32 GEMMs, rounded to bf16 where the kernels round (gate/up, silu, h,
    down; the weighted sum in fp32, rounded once): torch's own bf16 GEMMs round that way only
    where oneDNN accumulates in fp32 (AMX), not on every CPU."""
    inter = w1.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1])
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = (x[tok].float() @ w1[e].float().T).bfloat16().float()
        silu = torch.nn.functional.silu(gu[:, :inter]).bfloat16().float()
        h = (silu * gu[:, inter:]).bfloat16().float()
        down = (h @ w2[e].float().T).bfloat16().float()
        out.index_add_(0, tok, down * w[tok, slot, None].float())
    return out.bfloat16()
