"""The unquantized methods: plain `[out, in]` weights, `F.linear` and `F.embedding`."""

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm.config import get_current_vllm_config_or_none
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

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    """Embedding lookup and LM-head projection with a plain `[vocab, hidden]` weight."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        _create_plain_weight(layer, input_size_per_partition, output_partition_sizes,
                             params_dtype, extra_weight_attrs)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, layer.weight)
