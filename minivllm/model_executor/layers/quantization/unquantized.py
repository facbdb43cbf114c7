"""The unquantized methods: plain `[out, in]` weights; linears route through `kernels/cpu_linear.py`."""

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm.model_executor.kernels.cpu_linear import dispatch_linear, pack_for_cpu
from minivllm.model_executor.kernels.embedding import gather_rows
from minivllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from minivllm.model_executor.parameter import set_weight_attrs


class _PlainWeightMethod(QuantizeMethodBase):
    """A weight stored as is, in the activation dtype, and `y = x W^T + b` through the CPU routing."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        # [sum(output_partition_sizes), input_size_per_partition], the checkpoint's [out, in] layout
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                          dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return dispatch_linear(layer, x, bias)


class UnquantizedLinearMethod(_PlainWeightMethod):
    """`y = x W^T + b` with the weight stored in the activation dtype."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pack_for_cpu(layer)


class UnquantizedEmbeddingMethod(_PlainWeightMethod):
    """Embedding lookup and LM-head projection with a plain `[vocab, hidden]` weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # Only the LM head projects; an input embedding only looks rows up.
        if type(layer).__name__ == "ParallelLMHead":
            pack_for_cpu(layer)

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        if layer.weight.is_cpu and not torch.compiler.is_compiling():
            return gather_rows(layer.weight, input_)   # one native call (CPU graphs record it)
        return F.embedding(input_, layer.weight)

