"""Small layer helpers vLLM's model files import (vLLM's `layers.utils`)."""

import torch
import torch.nn.functional as F


def rocm_unquantized_gemm(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's ROCm GEMM entry (files call it on ROCm only): x [T, K] @ weight [N, K]^T + bias,
    computed with `F.linear` (minivllm has no ROCm kernels)."""
    return F.linear(x, weight, bias)
