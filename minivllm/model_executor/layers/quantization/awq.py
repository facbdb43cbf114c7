"""AWQ checkpoints (AutoAWQ's GEMM format), run by the int4 kernel after a repack at load time.

Checkpoint tensors per linear, K = in, N = out, g = `q_group_size`:
- `qweight` int32 [K, N/8]: eight 4-bit codes per int32 along the output dim, in AWQ's
  interleaved order: nibble i (bits 4i..4i+3) holds column `(0, 2, 4, 6, 1, 3, 5, 7)[i]`;
- `qzeros` int32 [K/g, N/8]: the integer zero points, packed the same way;
- `scales` fp16 [K/g, N]; the weight is `W[k, n] = (q - zp) * s` of its group.
"""

from typing import Any

import torch
import torch.nn as nn

from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase,
                                                                     is_layer_skipped)
from minivllm.model_executor.layers.quantization.int4 import (ACT_DTYPES, Int4LinearKernelMixin,
                                                              check_group_size, is_linear_layer,
                                                              set_int4_weights)
from minivllm.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from minivllm.model_executor.parameter import (GroupQuantScaleParameter, PackedvLLMParameter,
                                              register_weight_loader_v2_supported_method)

SUPPORTED_BITS = (4,)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# Position of column j's code among an int32's eight nibbles (the inverse of AWQ's pack order).
_AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_NOT_AWQ = ("This checkpoint is not an AWQ checkpoint (config.json has no AWQ "
            "quantization_config and there is no quant_config.json / quantize_config.json); "
            "to quantize an unquantized checkpoint online pass --quantization int4 (or fp8 / int8)")


class AWQConfig(QuantizationConfig):
    """AWQ: 4-bit weights, per-group scales and zero points (`zero_point: true`), GEMM layout."""

    def __init__(self, weight_bits: int, group_size: int, zero_point: bool,
                 modules_to_not_convert: list[str] | None = None) -> None:
        super().__init__()
        if weight_bits not in SUPPORTED_BITS:
            raise ValueError(f"AWQ with {weight_bits}-bit weights is not supported; supported "
                             f"bits: {', '.join(map(str, SUPPORTED_BITS))}")
        check_group_size("AWQ", group_size, SUPPORTED_GROUP_SIZES)
        if not zero_point:
            raise NotImplementedError("AWQ without zero points (zero_point: false) is not "
                                      "supported; AutoAWQ's GEMM checkpoints use zero_point: true")
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.pack_factor = 32 // weight_bits

    def __repr__(self) -> str:
        return (f"AWQConfig(weight_bits={self.weight_bits}, group_size={self.group_size}, "
                f"zero_point={self.zero_point}, "
                f"modules_to_not_convert={self.modules_to_not_convert})")

    def get_name(self) -> str:
        return "awq"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return list(ACT_DTYPES)

    @classmethod
    def get_min_capability(cls) -> int:
        return 75   # vLLM's; minivllm's CUDA path is plain PyTorch

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quant_config.json", "quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        method = str(config.get("quant_method", "awq")).lower()
        if not config or method != "awq":
            raise ValueError(_NOT_AWQ)
        version = str(cls.get_from_keys_or(config, ["version"], "gemm")).lower()
        if version != "gemm":
            raise NotImplementedError(f"AWQ version {version!r} is not supported; supported: "
                                      "'gemm' (AutoAWQ's default)")
        return cls(weight_bits=cls.get_from_keys(config, ["w_bit", "bits"]),
                   group_size=cls.get_from_keys(config, ["q_group_size", "group_size"]),
                   zero_point=cls.get_from_keys(config, ["zero_point"]),
                   modules_to_not_convert=cls.get_from_keys_or(
                       config, ["modules_to_not_convert"], None))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not is_linear_layer(layer):
            return None
        # AutoAWQ lists module names as substrings ("visual", "lm_head", "layers.0.mlp");
        # a fused layer is skipped only if all its shards are (else ValueError).
        if is_layer_skipped(prefix, self.modules_to_not_convert, self.packed_modules_mapping,
                            match_mode="substring"):
            return UnquantizedLinearMethod()
        return AWQLinearMethod(self)


@register_weight_loader_v2_supported_method
class AWQLinearMethod(Int4LinearKernelMixin, QuantizeMethodBase):
    """Loads `qweight` / `qzeros` / `scales`, then repacks them for `kernels/int4_linear`."""

    def __init__(self, quant_config: AWQConfig) -> None:
        self.quant_config = quant_config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        group_size, pack = self.quant_config.group_size, self.quant_config.pack_factor
        if input_size_per_partition % group_size != 0:
            raise ValueError(f"The input size {input_size_per_partition} is not a multiple of "
                             f"the AWQ group size {group_size} (too large a tensor-parallel "
                             "size?)")
        if any(size % pack != 0 for size in output_partition_sizes):
            raise ValueError(f"The output sizes {output_partition_sizes} are not multiples of "
                             f"AWQ's pack factor {pack} (too large a tensor-parallel size?)")
        out = sum(output_partition_sizes)
        num_groups = input_size_per_partition // group_size
        weight_loader = extra_weight_attrs["weight_loader"]
        layer.register_parameter("qweight", PackedvLLMParameter(
            data=torch.empty(input_size_per_partition, out // pack, dtype=torch.int32),
            input_dim=0, output_dim=1, packed_dim=1, packed_factor=pack,
            weight_loader=weight_loader))
        layer.register_parameter("qzeros", PackedvLLMParameter(
            data=torch.empty(num_groups, out // pack, dtype=torch.int32),
            input_dim=0, output_dim=1, packed_dim=1, packed_factor=pack,
            weight_loader=weight_loader))
        # fp32, not params_dtype: keeps the checkpoint's fp16 scales exact until the repack.
        layer.register_parameter("scales", GroupQuantScaleParameter(
            data=torch.empty(num_groups, out, dtype=torch.float32),
            input_dim=0, output_dim=1, weight_loader=weight_loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes = unpack_awq(layer.qweight.data).t()            # [K, N] -> [N, K]
        zero_points = unpack_awq(layer.qzeros.data).t()       # [N, K/g]
        scales = layer.scales.data.t()                        # [N, K/g]
        set_int4_weights(layer, codes, scales, zero_points, self.quant_config.group_size,
                         layer.params_dtype)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] in AWQ's nibble order -> uint8 codes [R, 8 C] in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    # [R, C, 8] in pack order; uint8 at once: one byte per code while the layer is repacked
    nibbles = ((packed.unsqueeze(-1) >> shifts) & 15).to(torch.uint8)
    order = torch.tensor(_AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles.index_select(-1, order).reshape(packed.shape[0], -1)
