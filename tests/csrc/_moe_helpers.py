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
