"""Online int8: `--quantization int8` on an unquantized checkpoint quantizes every linear weight,
after loading, to symmetric per-output-channel int8 (weight-only; activations stay bf16 / fp16 /
fp32). The matmul is `kernels/quant_linear.int8_linear` (`_weight_int8pack_mm` for decode rows).
"""

from typing import Any

import torch
import torch.nn as nn

from minivllm.model_executor.kernels.quant_linear import int8_linear, per_channel_int8_quant
from minivllm.model_executor.layers.linear import LinearBase
from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase,
                                                                     is_layer_skipped)
from minivllm.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from minivllm.model_executor.parameter import (ModelWeightParameter,
                                              register_weight_loader_v2_supported_method)


class Int8Config(QuantizationConfig):
    """Weight-only int8 computed online; `ignored_layers` stay in the activation dtype."""

    def __init__(self, ignored_layers: list[str] | None = None) -> None:
        super().__init__()
        self.ignored_layers = list(ignored_layers or [])

    def get_name(self) -> str:
        return "int8"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.half, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int8Config":
        """Only `{}` (an unquantized checkpoint) or an explicit `{"quant_method": "int8"}`."""
        method = config.get("quant_method")
        if method not in (None, "int8"):
            raise ValueError(f"int8 is online quantization of an unquantized checkpoint; this "
                             f"checkpoint is already quantized with {method!r} (use "
                             "--quantization compressed-tensors for int8 checkpoints)")
        return cls(ignored_layers=config.get("ignored_layers"))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        if is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping):
            return UnquantizedLinearMethod()
        return Int8LinearMethod()


@register_weight_loader_v2_supported_method
class Int8LinearMethod(QuantizeMethodBase):
    """Loads the weight in the activation dtype, then keeps int8 [out, in] + fp32 scales [out]."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        layer.logical_widths = list(output_partition_sizes)
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition,
                             dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=extra_weight_attrs["weight_loader"]))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = per_channel_int8_quant(layer.weight.data)
        layer.weight = nn.Parameter(weight, requires_grad=False)          # int8 [out, in]
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)     # fp32 [out]

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.data.float() * layer.weight_scale.data.reshape(-1, 1)
