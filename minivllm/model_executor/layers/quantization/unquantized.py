"""The unquantized methods: plain `[out, in]` weights, `F.linear` and `F.embedding`."""

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.compilation.ops import register_op
from minivllm.config import get_current_vllm_config_or_none
from minivllm.model_executor.layers.activation import silu_and_mul
from minivllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from minivllm.model_executor.parameter import set_weight_attrs


def _create_plain_weight(layer: nn.Module, input_size_per_partition: int,
                         output_partition_sizes: list[int], params_dtype: torch.dtype,
                         extra_weight_attrs: dict[str, Any]) -> None:
    # [sum(output_partition_sizes), input_size_per_partition], the checkpoint's [out, in] layout
    weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                      dtype=params_dtype), requires_grad=False)
    set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
    layer.register_parameter("weight", weight)
    set_weight_attrs(weight, extra_weight_attrs)


def _pack_for_cpu(layer: nn.Module) -> None:
    """Keep a oneDNN-blocked copy of a bf16 CPU weight: its GEMMs run ~2x faster at batch 1
    and ~1.3x at batch 64 than `F.linear` on the plain layout (measured on the 2-core CI box).

    The copy hangs on the weight itself (`weight._mkldnn_packed`), so `cpu_linear` finds it from
    the plain weight alone, also inside compiled graphs (which cannot hold oneDNN tensors).
    NOTE: the copy is taken once after loading; code that rewrites `weight` later must call
    this again. fp32 and other devices keep the plain `F.linear` path (and its exact numerics).
    """
    weight = getattr(layer, "weight", None)
    if weight is None:
        return
    weight._mkldnn_packed = None
    weight._gemv_ok, weight._amx_rows = False, 0
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16
            or not torch.backends.mkldnn.is_available()):
        return
    weight._mkldnn_packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    # Checked once here rather than per call: one-token steps call ~120 linears each.
    weight._gemv_ok = ops.gemv_supports_weight(weight)
    weight._amx_rows = ops.gemm_rows(weight)


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for x [T, in]. bf16 on CPU: up to `weight._amx_rows` rows (decode steps, bound
    by streaming the weight once; prompt chunks of up to 1024 rows for a weight that fits L2)
    through the native AMX GEMM, else one row through the native GEMV; more rows (prefill)
    through oneDNN's packed copy of `weight`."""
    packed = getattr(weight, "_mkldnn_packed", None)
    if packed is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
        rows = x.shape[0]
        if 0 < rows <= weight._amx_rows:
            return ops.gemm_bf16(x, weight, bias)
        if rows == 1 and weight._gemv_ok:
            return ops.gemv_bf16(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _cpu_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# `torch.ops.minivllm.cpu_linear`: `_cpu_linear` as an op compiled graphs call (they pass the
# plain weight parameter).
register_op("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _cpu_linear,
            _cpu_linear_fake)


def _cpu_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """SiluAndMul of `_cpu_linear(x, weight, bias)` for a gate_up weight [2d, in] (what the fusion
    pass puts in place of the pair): bf16 inputs the AMX GEMM takes in one native call, which
    applies the activation to each output block while it is in registers; others in two steps."""
    if (0 < x.shape[0] <= getattr(weight, "_amx_rows", 0) and x.dtype == torch.bfloat16
            and x.dim() == 2 and weight.shape[0] % 32 == 0):
        return ops.gemm_silu_mul_bf16(x, weight, bias)
    return silu_and_mul(_cpu_linear(x, weight, bias))


def _cpu_linear_silu_mul_fake(x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


register_op("cpu_linear_silu_mul(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
            _cpu_linear_silu_mul, _cpu_linear_silu_mul_fake)


def _linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    weight = layer.weight
    if torch.compiler.is_compiling():
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            return torch.ops.minivllm.cpu_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    return _cpu_linear(x, weight, bias)


class UnquantizedLinearMethod(QuantizeMethodBase):
    """`y = x W^T + b` with the weight stored in the activation dtype."""

    def __init__(self) -> None:
        config = get_current_vllm_config_or_none()
        kernel_config = getattr(config, "kernel_config", None) if config is not None else None
        # Only the PyTorch GEMM exists here; the name is kept for parity with vLLM's selection.
        self.linear_backend = getattr(kernel_config, "linear_backend", None) or "auto"

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        _create_plain_weight(layer, input_size_per_partition, output_partition_sizes,
                             params_dtype, extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        _pack_for_cpu(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(layer, x, bias)


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    """Embedding lookup and LM-head projection with a plain `[vocab, hidden]` weight."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        _create_plain_weight(layer, input_size_per_partition, output_partition_sizes,
                             params_dtype, extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # Only the LM head projects; an input embedding only looks rows up.
        if type(layer).__name__ == "ParallelLMHead":
            _pack_for_cpu(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(layer, x, bias)

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, layer.weight)
