"""`FusedMoEMethodBase` (vLLM's name): how a quantization method stores and runs MoE experts.

A `QuantizationConfig` whose `get_quant_method(layer, prefix)` returns one for a `FusedMoE`
takes over that layer's expert weights: `create_weights` registers them (with their
`weight_loader(param, w, weight_name, shard_id, expert_id, return_success=False)`), and
`apply` runs the routed experts once the layer has chosen them. A config returning None leaves
the experts as plain `w13_weight` / `w2_weight` tensors.
"""

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from minivllm.model_executor.layers.quantization.base_config import QuantizeMethodBase


class FusedMoEMethodBase(QuantizeMethodBase):
    """The experts of one FusedMoE layer in a quantized format."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        """Register the layer's expert parameters for its `num_experts` local experts."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]): x [T, H] -> [T, H], ids
        global (mapped through `layer.expert_map`), biases and activation as the layer states."""
