"""RMSNorm (contract section 7.2): normalise in fp32, multiply by the weight in its own dtype."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.parameter import default_weight_loader, set_weight_attrs


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             variance_size: int | None = None) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim; any leading shape."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x_var = x if variance_size is None else x[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       eps: float, variance_size: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`; the sum is taken in fp32, stored in x's dtype."""
    orig_dtype = x.dtype
    summed = x.to(torch.float32) + residual.to(torch.float32)
    new_residual = summed.to(orig_dtype)
    x_var = summed if variance_size is None else summed[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    normed = summed * torch.rsqrt(variance + eps)
    if weight is not None:
        normed = normed.to(weight.dtype) * weight
    return normed.to(orig_dtype), new_residual


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """Root-mean-square norm; `norm(x)` -> tensor, `norm(x, residual)` -> `(normed, x + residual)`.

    Works on any leading shape, e.g. per-head q/k norms on `[T, num_heads, head_dim]` views.
    NOTE: callers must treat `x` and `residual` as consumed (vLLM's fused kernel writes in place).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, var_hidden_size: int | None = None,
                 has_weight: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.variance_size_override = None if var_hidden_size == hidden_size else var_hidden_size
        self.has_weight = has_weight
        if has_weight:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype or torch.get_default_dtype()),
                                       requires_grad=False)
            # No `weight_loader`, as in vLLM: loaders fall back to the default one, and a model
            # file may set its own (vLLM's longcat_flash.py folds a scale into it).
            set_weight_attrs(self.weight, {"dummy_weight_value": 1.0})
        else:
            self.register_parameter("weight", None)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.variance_size_override is not None and x.shape[-1] < self.variance_size_override:
            raise ValueError(f"Expected the last dim to be at least {self.variance_size_override}, "
                             f"got {x.shape[-1]}")
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon, self.variance_size_override)
        return fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon,
                                  self.variance_size_override)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # torch.rms_norm is one op (~2x faster for decode-sized inputs than the native maths; 2
        # ops instead of 12 per call), and bf16 rows take the native kernel, ~2x faster again. It equals the native maths in fp32; in bf16/fp16 it accumulates in fp32
        # and rounds once instead of twice (a last-bit difference, as transformers' own norm).
        weight = self.weight
        if (self.variance_size_override is not None
                or (weight is not None and weight.dtype != x.dtype)):
            return self.forward_native(x, residual)
        if weight is not None and x.dim() in (2, 3) and not torch.compiler.is_compiling():
            # bf16 rows (or [T, heads, d] head views): one native pass instead of ~12 ops
            # (compiled graphs fuse it themselves).
            fused = ops.rms_norm_bf16(x, weight, self.variance_epsilon, residual)
            if fused is not None:
                return fused
        if residual is not None:
            x = x + residual.to(x.dtype)
            return torch.rms_norm(x, [x.shape[-1]], weight, self.variance_epsilon), x
        return torch.rms_norm(x, [x.shape[-1]], weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"


@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(CustomOp):
    """Gemma's RMSNorm: the weight is stored as an offset, applied as `(1 + w)`, all in fp32.

    Same call forms as `RMSNorm` (`norm(x)`, `norm(x, residual)`, any leading shape); the sum
    `x + residual` is rounded to x's dtype before the norm, as transformers' Gemma does it.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        # A zero offset is the identity scale; checkpoints store w, not 1 + w.
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader,
                                       "dummy_weight_value": 0.0})

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual.to(x.dtype)
            residual = x
        normed = rms_norm(x.float(), None, self.variance_epsilon)
        out = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"


class LayerNorm(nn.Module):
    """Mean-centred layer norm over the last dim, computed in fp32 (vLLM 0.33's arguments).

    `elementwise_affine=False` has no parameters; `bias=False` (or `has_bias=False`, the older
    spelling) gives the weight-only form (Cohere's). Parameters are fp32 unless `dtype` is given.
    `norm(x, residual)` returns `(norm(x + residual), x + residual)`, the same call form as
    `RMSNorm`.
    """

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, dtype: torch.dtype | None = None, *,
                 has_bias: bool | None = None) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        bias = bias if has_bias is None else has_bias
        dtype = dtype or torch.float32
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})
            if bias:
                self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
                set_weight_attrs(self.bias, {"weight_loader": default_weight_loader})

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual.to(x.dtype)
            residual = x
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), (self.dim,), weight, bias, self.eps).to(x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}, bias={self.bias is not None}"


@CustomOp.register("rms_norm_gated")
class RMSNormGated(CustomOp):
    """RMS norm with a gate (Mamba-2 / Gated DeltaNet outputs), vLLM 0.33's arguments.

    x, z [..., hidden_size]. norm_before_gate: rms_norm(x) * w * act(z); otherwise
    rms_norm(x * act(z)) * w. group_size normalises each group of that many channels on its
    own (None: one group). activation is "silu" / "swish" (the same) or "sigmoid". fp32 inside.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, activation: str = "swish") -> None:
        super().__init__()
        if activation not in ("silu", "swish", "sigmoid"):
            raise ValueError(f"RMSNormGated activation must be one of silu, swish, sigmoid; "
                             f"got {activation!r}")
        if group_size is not None and hidden_size % group_size:
            raise ValueError(f"group_size {group_size} does not divide {hidden_size}")
        self.eps, self.activation = eps, activation
        self.group_size, self.norm_before_gate = group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype),
                                   requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader,
                                       "dummy_weight_value": 1.0})
        self.register_parameter("bias", None)

    def forward_native(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        act = torch.sigmoid if self.activation == "sigmoid" else F.silu
        x = x.float()
        if z is not None and not self.norm_before_gate:
            x = x * act(z.float())
        size = self.group_size or x.shape[-1]
        groups = x.view(*x.shape[:-1], -1, size)                     # [..., G, size]
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        out = normed.view(x.shape) * self.weight.float()
        if z is not None and self.norm_before_gate:
            out = out * act(z.float())
        return out.to(dtype)
