"""Quantization helpers at vLLM's path (`quantization.utils.quant_utils`): group shapes, scaled
dequantisation, the dense weight of any linear layer, and `is_layer_skipped` (a re-export:
its home is `base_config.py`)."""

from typing import ClassVar, NamedTuple

import torch
from torch import nn

from minivllm.model_executor.layers.quantization.base_config import is_layer_skipped  # noqa: F401


class _GroupShape(NamedTuple):
    row: int
    col: int


class GroupShape(_GroupShape):
    """The block of values one scale covers: (rows, cols), -1 meaning the whole dimension."""

    PER_TENSOR: ClassVar["GroupShape"]
    PER_TOKEN: ClassVar["GroupShape"]
    PER_CHANNEL: ClassVar["GroupShape"]

    def is_per_tensor(self) -> bool:
        return self.row == -1 and self.col == -1

    def is_per_token(self) -> bool:
        return self.row == 1 and self.col == -1

    def is_per_channel(self) -> bool:
        return self.row == -1 and self.col == 1

    def is_per_group(self) -> bool:
        return self.row == 1 and self.col >= 1


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)
GroupShape.PER_CHANNEL = GroupShape(-1, 1)


def scaled_dequantize(x_q: torch.Tensor, x_s: torch.Tensor,
                      group_shape: GroupShape | None = None,
                      out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_q [..., M, N] times its scales x_s (one per `group_shape` block; a scalar or
    [..., M/r, N/c]), in `out_dtype`."""
    scale = x_s.float()
    if scale.dim() >= 2 and scale.shape[-2:] != x_q.shape[-2:]:
        rows = x_q.shape[-2] // scale.shape[-2] if group_shape is None or group_shape.row == -1 \
            else group_shape.row
        cols = x_q.shape[-1] // scale.shape[-1] if group_shape is None or group_shape.col == -1 \
            else group_shape.col
        scale = scale.repeat_interleave(rows, -2).repeat_interleave(cols, -1)
        scale = scale[..., :x_q.shape[-2], :x_q.shape[-1]]
    return (x_q.float() * scale).to(out_dtype)


def scaled_quantize(x: torch.Tensor, group_shape: GroupShape, quant_dtype: torch.dtype,
                    compute_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] quantised per `group_shape` block (-1: the whole dimension) to the float
    `quant_dtype` (fp8): (x_q [M, N], the dequantisation scales [M/r, N/c] fp32) with
    x ~ x_q * scale, each block's largest magnitude at the dtype's largest value."""
    if not quant_dtype.is_floating_point:
        raise ValueError(f"scaled_quantize takes a floating-point quant_dtype (fp8), got "
                         f"{quant_dtype}")
    rows = group_shape[0] if group_shape[0] > 0 else x.shape[-2]
    cols = group_shape[1] if group_shape[1] > 0 else x.shape[-1]
    if x.dim() != 2 or x.shape[0] % rows or x.shape[1] % cols:
        raise ValueError(f"scaled_quantize needs a 2-D tensor whose dims the group shape "
                         f"({rows}, {cols}) divides, got {tuple(x.shape)}")
    blk_m, blk_n = x.shape[0] // rows, x.shape[1] // cols
    xc = x if compute_dtype is None else x.to(compute_dtype)
    blocks = xc.reshape(blk_m, rows, blk_n, cols).permute(0, 2, 1, 3)   # [bm, bn, r, c]
    amax = blocks.abs().amax(dim=(-2, -1)).clamp(min=1e-12)            # [bm, bn]
    finfo = torch.finfo(quant_dtype)
    scale = finfo.max / amax
    q = (blocks * scale[..., None, None]).clamp(finfo.min, finfo.max)
    q = q.permute(0, 2, 1, 3).reshape(x.shape)
    return q.to(quant_dtype).contiguous(), scale.float().reciprocal()


def get_and_maybe_dequant_weights(layer: nn.Module,
                                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A linear layer's weight [out, in] (this rank's part) in `out_dtype`: the plain parameter
    when it is one, else the quant method's `dequantize_weight`, else the layer applied to the
    identity (GGUF: its kernels dequantise exactly; bias-free layers whose output is not
    all-reduced only)."""
    while hasattr(layer, "base_layer") and hasattr(layer.base_layer, "quant_method"):
        layer = layer.base_layer                       # a LoRA wrapper: its base layer
    if getattr(layer, "bias", None) is not None or (
            getattr(layer, "reduce_results", False) and getattr(layer, "tp_size", 1) > 1):
        raise ValueError(f"{type(layer).__name__}: only bias-free layers whose output is not "
                         "all-reduced can be dequantised through their kernel")
    weight = getattr(layer, "weight", None)
    method = getattr(layer, "quant_method", None)
    if type(method).__name__ == "UnquantizedLinearMethod" and isinstance(weight, torch.Tensor):
        return weight if weight.dtype == out_dtype else weight.to(out_dtype)
    try:                              # the method's own exact dequantisation, where it has one
        return method.dequantize_weight(layer).to(out_dtype)
    except (AttributeError, NotImplementedError):
        pass
    eye = torch.eye(layer.input_size_per_partition if hasattr(layer, "input_size_per_partition")
                    else layer.input_size, dtype=out_dtype)
    with torch.no_grad():
        out = layer(eye)
    out = out[0] if isinstance(out, tuple) else out     # [in, out] = W^T
    return out.t().contiguous()
