"""Activation functions; gated ones take `[..., 2 * d]` and return `[..., d]`."""

import torch
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.kernels.activation import silu_and_mul, silu_and_mul_torch


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """`silu(x[..., :d]) * x[..., d:]` (the gate/up halves of a fused gate_up_proj output)."""

    def __init__(self, *, compile_native: bool = True) -> None:
        super().__init__(compile_native=compile_native)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_torch(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        # bf16: the native kernel (same roundings as forward_native); compiled graphs keep it as
        # one op, which the fusion pass folds into a preceding bf16 linear.
        if x.dtype == torch.bfloat16 and x.dim() == 2 and ops.native_available():
            if torch.compiler.is_compiling():
                return torch.ops.minivllm.silu_and_mul(x)
            return silu_and_mul(x)
        return self.forward_native(x)


@CustomOp.register("gelu_and_mul")
class GeluAndMul(CustomOp):
    """`gelu(x[..., :d]) * x[..., d:]`, exact ("none") or tanh-approximated GELU."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


@CustomOp.register("relu2")
class ReLUSquaredActivation(CustomOp):
    """`relu(x) ** 2` (Primer / Nemotron MLPs)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))
