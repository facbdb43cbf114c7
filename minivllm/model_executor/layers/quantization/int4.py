"""Online weight-only int4 (`--quantization int4`), and the int4 linear method AWQ and GPTQ share.

The online method loads an unquantized checkpoint as usual (bf16 `weight` [out, in]) and, after
loading, quantizes each linear per group of `group_size` input columns: asymmetric (a scale and an
integer zero point per group, `W ~ (q - zp) * s`) by default, or symmetric (`zp = 8`). The dense
weight is then dropped; `kernels/int4_linear.py` computes the matmul from the packed codes.
"""

from typing import Any

import torch
import torch.nn as nn

from minivllm.model_executor.kernels.int4_linear import dequantize_int4, int4_linear, pack_int4
from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase,
                                                                     is_layer_skipped)
from minivllm.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod

SUPPORTED_GROUP_SIZES = (32, 64, 128)
ACT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Weights quantized at once (whole rows): the fp32 temporaries of a big layer stay ~128 MB.
_QUANTIZE_CHUNK = 1 << 24


class Int4Config(QuantizationConfig):
    """Online int4: `group_size` input columns share a scale (and a zero point unless `sym`).

    `group_size` None (the default): per layer the largest of 128, 64, 32 that divides its input
    size (SmolLM2's hidden size 576 takes 64).
    """

    def __init__(self, group_size: int | None = None, sym: bool = False,
                 ignored_layers: list[str] | None = None) -> None:
        super().__init__()
        if group_size is not None:
            check_group_size("int4", group_size, SUPPORTED_GROUP_SIZES)
        self.group_size = group_size
        self.sym = sym
        self.ignored_layers = list(ignored_layers or [])

    def __repr__(self) -> str:
        return f"Int4Config(group_size={self.group_size}, sym={self.sym})"

    def get_name(self) -> str:
        return "int4"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return list(ACT_DTYPES)

    @classmethod
    def get_min_capability(cls) -> int:
        return 0   # pure PyTorch off CPU: any GPU

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int4Config":
        method = config.get("quant_method")
        if method not in (None, "int4"):
            raise ValueError(f"This checkpoint is already quantized ({method!r}); --quantization "
                             f"int4 quantizes unquantized checkpoints: drop it or pass "
                             f"--quantization {method}")
        return cls(group_size=cls.get_from_keys_or(config, ["group_size"], None),
                   sym=cls.get_from_keys_or(config, ["sym"], False),
                   ignored_layers=cls.get_from_keys_or(config, ["ignored_layers"], None))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not is_linear_layer(layer):
            return None   # embeddings and the LM head stay in the activation dtype
        if is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping):
            return UnquantizedLinearMethod()
        return Int4LinearMethod(self)


class Int4LinearKernelMixin:
    """`apply` and `dequantize_weight` over the packed form that `set_int4_weights` leaves."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return int4_linear(x, layer.qweight, layer.scales_and_zeros, layer.int4_group_size,
                           bias, layer.input_perm)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        """The dense [out, in] weight in the checkpoint's input order (tests, debugging)."""
        weight = dequantize_int4(layer.qweight, layer.scales_and_zeros, layer.int4_group_size)
        if layer.input_perm is not None:
            # x[:, perm] @ W_sorted^T == x @ W^T with W[:, perm] = W_sorted
            weight = torch.empty_like(weight).index_copy_(1, layer.input_perm, weight)
        return weight


class Int4LinearMethod(Int4LinearKernelMixin, UnquantizedLinearMethod):
    """Loads the dense weight like the unquantized method; quantizes it after loading."""

    def __init__(self, quant_config: Int4Config) -> None:
        super().__init__()
        self.quant_config = quant_config

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data                       # [N, K]
        group_size = self.quant_config.group_size or _default_group_size(
            weight.shape[1], getattr(layer, "prefix", ""))
        codes, scales, zero_points = quantize_int4(weight, group_size, self.quant_config.sym)
        del layer.weight                                 # no dense copy stays behind
        set_int4_weights(layer, codes, scales, zero_points, group_size, weight.dtype)


def quantize_int4(weight: torch.Tensor, group_size: int,
                  sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of `weight` [N, K] per group of `group_size` columns.

    Returns (codes [N, K] uint8 in [0, 16), scales and zero points [N, K/g] fp32) with
    `weight ~ (codes - zp) * scale`. Symmetric: `zp = 8`, scale = amax / 7.5 (codes -8 .. 7).
    """
    num_out, num_in = weight.shape
    if num_in % group_size != 0:
        raise ValueError(f"The input size {num_in} is not a multiple of the int4 group size "
                         f"{group_size}; choose one of {SUPPORTED_GROUP_SIZES} that divides it")
    step = max(1, _QUANTIZE_CHUNK // num_in)
    parts = [_quantize_rows(weight[start:start + step], group_size, sym)
             for start in range(0, num_out, step)]
    codes, scales, zero_points = (torch.cat(p) for p in zip(*parts))
    return codes, scales, zero_points


def _quantize_rows(weight: torch.Tensor, group_size: int,
                   sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, num_in = weight.shape
    groups = weight.float().view(rows, num_in // group_size, group_size)
    if sym:
        scales = groups.abs().amax(dim=-1) / 7.5
        zero_points = torch.full_like(scales, 8.0)
    else:
        low = groups.amin(dim=-1).clamp(max=0.0)         # keep 0 exactly representable
        high = groups.amax(dim=-1).clamp(min=0.0)
        scales = (high - low) / 15.0
        zero_points = torch.round(-low / scales.clamp(min=1e-12)).clamp(0, 15)
    scales = scales.clamp(min=1e-12)                     # an all-zero group: codes = zp
    codes = torch.round(groups / scales[..., None]).add_(zero_points[..., None])
    return codes.clamp_(0, 15).to(torch.uint8).view(rows, num_in), scales, zero_points


def set_int4_weights(layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor,
                     zero_points: torch.Tensor, group_size: int, dtype: torch.dtype,
                     perm: torch.Tensor | None = None) -> None:
    """Store the kernel's form on `layer`: `qweight` (packed uint8 [N, K/2]), `scales_and_zeros`,
    `input_perm` (or None) and `int4_group_size`; the checkpoint tensors must be gone already.

    codes [N, K], scales / zero_points [N, K/group_size], `W ~ (codes - zp) * scales`.
    """
    packed, scales_and_zeros, kernel_group = pack_int4(codes, scales, zero_points, group_size,
                                                       dtype)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        if name in layer._parameters:
            del layer._parameters[name]
    layer.qweight = nn.Parameter(packed, requires_grad=False)
    layer.scales_and_zeros = nn.Parameter(scales_and_zeros, requires_grad=False)
    layer.register_buffer("input_perm", perm, persistent=False)
    layer.int4_group_size = kernel_group


def _default_group_size(num_in: int, prefix: str) -> int:
    for group_size in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if num_in % group_size == 0:
            return group_size
    sizes = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
    raise ValueError(f"int4 cannot quantize {prefix or 'a linear'}: its input size {num_in} is "
                     f"not a multiple of any group size ({sizes}); leave it out with "
                     "ignored_layers")


def check_group_size(method: str, group_size: int, supported: tuple[int, ...]) -> None:
    if group_size not in supported:
        raise ValueError(f"{method} with group_size {group_size} is not supported; supported "
                         f"group sizes: {', '.join(map(str, supported))}")


def is_linear_layer(layer: nn.Module) -> bool:
    """Whether `layer` is a LinearBase (the layers that int4 methods quantize)."""
    # By class name: importing layers/linear.py here would be a cycle (it imports this package).
    return any(cls.__name__ == "LinearBase" for cls in type(layer).__mro__)
