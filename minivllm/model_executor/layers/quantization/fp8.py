"""fp8 (e4m3) linears: checkpoints with `quant_method: "fp8"` and online fp8 of bf16 checkpoints.

Checkpoint layouts (vLLM's names):
- per-tensor: `weight` e4m3 [out, in], `weight_scale` one fp32 per logical matrix (q/k/v, gate/up
  of a fused layer are kept apart: the kernel applies them per output channel), optional
  `input_scale` (activation_scheme "static"; the fused layer uses the max, as vLLM does);
- block-wise (`weight_block_size: [bn, bk]`): `weight_scale_inv` [ceil(out/bn), ceil(in/bk)],
  dynamic per-token-group activations.
Online (`--quantization fp8` on an unquantized checkpoint, `from_config({})`): the bf16 weight is
loaded, then replaced by e4m3 + one dynamic per-tensor scale (vLLM's default) or per channel.
Activations run in bf16 / fp16; with activation_scheme static/dynamic they are rounded to e4m3 as
vLLM's W8A8 kernels do (`kernels/quant_linear.py`).
"""

from typing import Any

import torch
import torch.nn as nn

from minivllm.model_executor.kernels.quant_linear import (FP8_DTYPE, fp8_block_linear, fp8_linear,
                                                          per_channel_fp8_quant,
                                                          per_tensor_fp8_quant)
from minivllm.model_executor.layers.linear import LinearBase
from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase,
                                                                     is_layer_skipped)
from minivllm.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from minivllm.model_executor.parameter import (BlockQuantScaleParameter, ModelWeightParameter,
                                              PerTensorScaleParameter,
                                              register_weight_loader_v2_supported_method)

ACTIVATION_SCHEMES = ("static", "dynamic")
ONLINE_WEIGHT_STRATEGIES = ("tensor", "channel")


class Fp8Config(QuantizationConfig):
    """The fp8 scheme of one checkpoint (or of online quantization)."""

    def __init__(self, is_checkpoint_fp8_serialized: bool = False,
                 activation_scheme: str = "dynamic", ignored_layers: list[str] | None = None,
                 weight_block_size: list[int] | None = None,
                 online_weight_strategy: str = "tensor") -> None:
        super().__init__()
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"Unsupported fp8 activation_scheme {activation_scheme!r}; "
                             f"supported: {', '.join(ACTIVATION_SCHEMES)}")
        if not is_checkpoint_fp8_serialized and activation_scheme == "static":
            raise ValueError("Online fp8 quantization has no activation scales: "
                             "activation_scheme 'static' needs an fp8 checkpoint")
        if weight_block_size is not None:
            if not is_checkpoint_fp8_serialized:
                raise ValueError("Block-wise fp8 (weight_block_size) needs an fp8 checkpoint")
            if len(weight_block_size) != 2:
                raise ValueError(f"weight_block_size must be [block_n, block_k], got "
                                 f"{weight_block_size}")
            if activation_scheme != "dynamic":
                raise ValueError("Block-wise fp8 supports only activation_scheme 'dynamic'")
        if online_weight_strategy not in ONLINE_WEIGHT_STRATEGIES:
            raise ValueError(f"Unsupported online fp8 weight strategy {online_weight_strategy!r}; "
                             f"supported: {', '.join(ONLINE_WEIGHT_STRATEGIES)}")
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers or [])
        self.weight_block_size = list(weight_block_size) if weight_block_size else None
        self.online_weight_strategy = online_weight_strategy

    def get_name(self) -> str:
        return "fp8"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.half]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        """config.json's `quantization_config`; `{}` (an unquantized checkpoint) means online."""
        quant_method = cls.get_from_keys_or(config, ["quant_method"], "")
        return cls(is_checkpoint_fp8_serialized="fp8" in quant_method,
                   activation_scheme=cls.get_from_keys_or(config, ["activation_scheme"], "dynamic"),
                   ignored_layers=cls.get_from_keys_or(
                       config, ["ignored_layers", "modules_to_not_convert"], None),
                   weight_block_size=cls.get_from_keys_or(config, ["weight_block_size"], None),
                   online_weight_strategy=cls.get_from_keys_or(config, ["weight_strategy"],
                                                               "tensor"))

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        # Ignored layers are checkpoint names; models that rename modules rename them too.
        if self.ignored_layers and hasattr(hf_to_vllm_mapper, "apply_list"):
            self.ignored_layers = hf_to_vllm_mapper.apply_list(self.ignored_layers)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None    # embeddings, the LM head and attention stay unquantized
        if is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self)


@register_weight_loader_v2_supported_method
class Fp8LinearMethod(QuantizeMethodBase):
    """Creates, post-processes and applies one linear's fp8 weights."""

    def __init__(self, quant_config: Fp8Config) -> None:
        self.quant_config = quant_config
        self.block_quant = quant_config.weight_block_size is not None
        self.serialized = quant_config.is_checkpoint_fp8_serialized

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        weight_loader = extra_weight_attrs["weight_loader"]
        out_rows = sum(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.orig_dtype = params_dtype
        # [out / T, in] e4m3 from the checkpoint, or the activation dtype for online quantization
        weight_dtype = FP8_DTYPE if self.serialized else params_dtype
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(out_rows, input_size_per_partition, dtype=weight_dtype),
            input_dim=1, output_dim=0, weight_loader=weight_loader))
        if not self.serialized:
            return
        if self.block_quant:
            self._create_block_scales(layer, input_size_per_partition, output_partition_sizes,
                                      weight_loader)
        else:
            # [num logical matrices]; -inf-like fill shows a shard the checkpoint never set
            scale = torch.full((len(output_partition_sizes),), torch.finfo(torch.float32).min,
                               dtype=torch.float32)
            layer.register_parameter("weight_scale", PerTensorScaleParameter(
                data=scale, weight_loader=weight_loader))
        if self.quant_config.activation_scheme == "static":
            scale = torch.full((len(output_partition_sizes),), torch.finfo(torch.float32).min,
                               dtype=torch.float32)
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                data=scale, weight_loader=weight_loader))

    def _create_block_scales(self, layer: nn.Module, input_size_per_partition: int,
                             output_partition_sizes: list[int], weight_loader: Any) -> None:
        block_n, block_k = self.quant_config.weight_block_size
        # Every shard (and TP slice) must start on a block edge to own whole scale blocks.
        tp_size = getattr(layer, "tp_size", 1)
        if len(output_partition_sizes) > 1 or tp_size > 1:
            for size in output_partition_sizes:
                if size % block_n:
                    raise ValueError(f"{layer.prefix}: output partition size {size} is not a "
                                     f"multiple of weight_block_size[0] = {block_n}")
        if tp_size > 1 and input_size_per_partition % block_k and \
                type(layer).__name__ == "RowParallelLinear":
            raise ValueError(f"{layer.prefix}: input partition size {input_size_per_partition} "
                             f"is not a multiple of weight_block_size[1] = {block_k}")
        layer.weight_block_size = [block_n, block_k]
        rows = (sum(output_partition_sizes) + block_n - 1) // block_n
        cols = (input_size_per_partition + block_k - 1) // block_k
        layer.register_parameter("weight_scale_inv", BlockQuantScaleParameter(
            data=torch.empty(rows, cols, dtype=torch.float32), input_dim=1, output_dim=0,
            weight_loader=weight_loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Online: quantize the loaded weight. Per-tensor checkpoints: per-shard scales become
        one per output channel ([out]); static input scales collapse to their max."""
        if not self.serialized:
            if self.quant_config.online_weight_strategy == "channel":
                weight, scale = per_channel_fp8_quant(layer.weight.data)
            else:
                weight, scale = per_tensor_fp8_quant(layer.weight.data)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            return
        layer.weight = nn.Parameter(layer.weight.data, requires_grad=False)
        if self.block_quant:
            layer.weight_scale_inv = nn.Parameter(layer.weight_scale_inv.data, requires_grad=False)
            return
        scales = layer.weight_scale.data
        if (scales == torch.finfo(torch.float32).min).any():
            raise ValueError(f"{layer.prefix}: the checkpoint has no weight_scale for some of its "
                             f"shards (scales {scales.tolist()})")
        if scales.numel() > 1:
            widths = torch.tensor(layer.logical_widths)
            scales = scales.repeat_interleave(widths)       # [out], one per output channel
        layer.weight_scale = nn.Parameter(scales.float(), requires_grad=False)
        if self.quant_config.activation_scheme == "static":
            input_scale = layer.input_scale.data.max().reshape(1)
            layer.input_scale = nn.Parameter(input_scale.float(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.block_quant:
            return fp8_block_linear(x, layer.weight, layer.weight_scale_inv,
                                    layer.weight_block_size, bias)
        input_scale = getattr(layer, "input_scale", None)
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, input_scale=input_scale,
                          quantize_input=True)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as the kernel sees it, in fp32 [out, in] (for tests and conversions)."""
        weight = layer.weight.data.float()
        if self.block_quant:
            bn, bk = layer.weight_block_size
            scales = layer.weight_scale_inv.data.repeat_interleave(bn, 0)[:weight.shape[0]]
            return weight * scales.repeat_interleave(bk, 1)[:, :weight.shape[1]]
        return weight * layer.weight_scale.data.reshape(-1, 1)
