"""SiluAndMul's math on `[..., 2 * d]` -> `[..., d]`: the native kernel for bf16 rows, else torch."""

import torch
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels.op_library import register_op


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` in torch (the reference the native kernel matches)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]`: the native kernel for bf16 rows on CPU, else torch."""
    y = ops.silu_and_mul_bf16(x)
    return y if y is not None else silu_and_mul_torch(x)


def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


# `torch.ops.minivllm.silu_and_mul`: an opaque op in compiled graphs, so the fusion pass
# (compilation/fusion.py) can find it behind the linear that produces its input.
register_op("silu_and_mul(Tensor x) -> Tensor", silu_and_mul, _silu_and_mul_fake)
