"""Activation functions; gated ones take `[..., 2 * d]` and return `[..., d]`."""

import torch
import torch.nn.functional as F

from minivllm.model_executor.custom_op import CustomOp


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """`silu(x[..., :d]) * x[..., d:]` (the gate/up halves of a fused gate_up_proj output)."""

    def __init__(self, *, compile_native: bool = True) -> None:
        super().__init__(compile_native=compile_native)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


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
