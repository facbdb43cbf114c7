"""The 8-bit compressed-tensors schemes (vLLM's names): fp8 W8A8 / W8A16 and int8 W8A8 / W8A16.

Each scheme creates a linear's checkpoint parameters (`weight`, `weight_scale`, `input_scale`),
post-processes them into what `kernels/quant_linear.py` takes (fp32 scales per output channel
[out] or per tensor [1]; block scales stay [ceil(out/bn), ceil(in/bk)]) and applies the matmul.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from minivllm.model_executor.kernels.quant_linear import (FP8_DTYPE, fp8_block_linear, fp8_linear,
                                                          int8_linear)
from minivllm.model_executor.parameter import (BlockQuantScaleParameter,
                                              ChannelQuantScaleParameter, ModelWeightParameter,
                                              PerTensorScaleParameter)


@dataclass(frozen=True)
class QuantArgs:
    """One `weights` / `input_activations` entry of a compressed-tensors config group."""

    num_bits: int = 8
    type: str = "int"                      # "int" or "float"
    strategy: str = "tensor"               # "tensor", "channel", "group", "block", "token"
    symmetric: bool = True
    dynamic: bool = False
    group_size: int | None = None
    block_structure: list[int] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantArgs":
        return cls(num_bits=d.get("num_bits", 8), type=d.get("type", "int"),
                   strategy=d.get("strategy") or "tensor", symmetric=d.get("symmetric", True),
                   dynamic=bool(d.get("dynamic", False)), group_size=d.get("group_size"),
                   block_structure=d.get("block_structure"))


class CompressedTensorsScheme:
    """Shared parameter creation of the 8-bit schemes; subclasses pick dtypes and kernels."""

    weight_dtype: torch.dtype

    def __init__(self, weights: QuantArgs, input_activations: QuantArgs | None) -> None:
        self.weights = weights
        self.input_activations = input_activations
        self.is_static_input_scheme = input_activations is not None and not input_activations.dynamic

    def create_weights(self, layer: nn.Module, output_partition_sizes: list[int],
                       input_size_per_partition: int, weight_loader: Any) -> None:
        out_rows = sum(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(out_rows, input_size_per_partition, dtype=self.weight_dtype),
            input_dim=1, output_dim=0, weight_loader=weight_loader))
        strategy = self.weights.strategy
        if strategy == "channel":          # [out, 1], as llm-compressor saves it
            scale = ChannelQuantScaleParameter(data=torch.empty(out_rows, 1, dtype=torch.float32),
                                               output_dim=0, weight_loader=weight_loader)
        elif strategy == "block":
            block_n, block_k = self.weights.block_structure
            layer.weight_block_size = [block_n, block_k]
            scale = BlockQuantScaleParameter(
                data=torch.empty(-(-out_rows // block_n), -(-input_size_per_partition // block_k),
                                 dtype=torch.float32),
                input_dim=1, output_dim=0, weight_loader=weight_loader)
        else:                              # "tensor": one per logical matrix of a fused layer
            scale = PerTensorScaleParameter(data=_unset(len(output_partition_sizes)),
                                            weight_loader=weight_loader)
        layer.register_parameter("weight_scale", scale)
        if self.is_static_input_scheme:
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                data=_unset(len(output_partition_sizes)), weight_loader=weight_loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight = nn.Parameter(layer.weight.data, requires_grad=False)
        scale = layer.weight_scale.data.float()
        if self.weights.strategy == "tensor":
            if (scale == torch.finfo(torch.float32).min).any():
                raise ValueError(f"{layer.prefix}: the checkpoint has no weight_scale for some "
                                 f"of its shards (scales {scale.tolist()})")
            if scale.numel() > 1:          # per-shard scales -> one per output channel
                scale = scale.repeat_interleave(torch.tensor(layer.logical_widths))
        elif self.weights.strategy == "channel":
            scale = scale.reshape(-1)      # [out]
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if self.is_static_input_scheme:
            # One activation scale for the fused matmul: the largest of its shards (as vLLM).
            input_scale = layer.input_scale.data.max().reshape(1).float()
            layer.input_scale = nn.Parameter(input_scale, requires_grad=False)

    def apply_weights(self, layer: nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class CompressedTensorsW8A8Fp8(CompressedTensorsScheme):
    """fp8 weights (tensor / channel / block) and fp8 activations (static per tensor, dynamic
    per tensor or per token, or per token group for block weights)."""

    weight_dtype = FP8_DTYPE

    def apply_weights(self, layer: nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        if self.weights.strategy == "block":
            return fp8_block_linear(x, layer.weight, layer.weight_scale, layer.weight_block_size,
                                    bias)
        return fp8_linear(x, layer.weight, layer.weight_scale, bias,
                          input_scale=getattr(layer, "input_scale", None), quantize_input=True,
                          per_token=self.input_activations.strategy == "token")


class CompressedTensorsW8A16Fp8(CompressedTensorsScheme):
    """fp8 weights, activations left in bf16 / fp16 (weight-only)."""

    weight_dtype = FP8_DTYPE

    def apply_weights(self, layer: nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        if self.weights.strategy == "block":
            return fp8_block_linear(x, layer.weight, layer.weight_scale, layer.weight_block_size,
                                    bias, quantize_input=False)
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)


class CompressedTensorsW8A8Int8(CompressedTensorsScheme):
    """Symmetric int8 weights and int8 activations (dynamic per token or static per tensor)."""

    weight_dtype = torch.int8

    def apply_weights(self, layer: nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias,
                           input_scale=getattr(layer, "input_scale", None), quantize_input=True)


class CompressedTensorsW8A16Int8(CompressedTensorsScheme):
    """Symmetric int8 weights, activations left in the model dtype (weight-only)."""

    weight_dtype = torch.int8

    def apply_weights(self, layer: nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


SUPPORTED_SCHEMES = (
    "W8A8 fp8 (type float; weights tensor/channel, activations static tensor or dynamic "
    "tensor/token; or block weights with dynamic group activations, group = block columns)",
    "W8A16 fp8 (type float weights tensor/channel/block, input_activations null)",
    "W8A8 int8 (type int, symmetric; weights tensor/channel, activations dynamic token or static "
    "tensor)",
    "W8A16 int8 (type int, symmetric; weights tensor/channel, input_activations null)",
)


def get_scheme(weights: QuantArgs, input_activations: QuantArgs | None) -> CompressedTensorsScheme:
    """The scheme for one config group, or ValueError naming the supported ones."""
    w, a = weights, input_activations
    ok_weights = (w.num_bits == 8 and w.symmetric and w.type in ("float", "int")
                  and (w.strategy in ("tensor", "channel")
                       or (w.strategy == "block" and w.type == "float"
                           and w.block_structure is not None and len(w.block_structure) == 2)))
    if ok_weights and a is None:
        return (CompressedTensorsW8A16Fp8 if w.type == "float" else CompressedTensorsW8A16Int8)(w, a)
    if ok_weights and a.num_bits == 8 and a.type == w.type and a.symmetric:
        if w.type == "float":
            # block weights: activations in groups of the weight's block columns (as vLLM)
            dynamic_ok = a.strategy in ("tensor", "token") if w.strategy != "block" \
                else a.strategy == "group" and a.group_size in (None, w.block_structure[1])
            if (a.dynamic and dynamic_ok) or (not a.dynamic and a.strategy == "tensor"
                                              and w.strategy != "block"):
                return CompressedTensorsW8A8Fp8(w, a)
        elif (a.dynamic and a.strategy == "token") or (not a.dynamic and a.strategy == "tensor"):
            return CompressedTensorsW8A8Int8(w, a)
    raise ValueError(f"Unsupported compressed-tensors scheme: weights {w}, input_activations "
                     f"{a}. Supported schemes: {'; '.join(SUPPORTED_SCHEMES)}")


def _unset(n: int) -> torch.Tensor:
    # A fill no checkpoint writes: process_weights_after_loading finds a shard left unloaded.
    return torch.full((n,), torch.finfo(torch.float32).min, dtype=torch.float32)
