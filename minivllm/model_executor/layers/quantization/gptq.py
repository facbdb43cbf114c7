"""GPTQ checkpoints (AutoGPTQ / GPTQModel), run by the int4 kernel after a repack at load time.

Checkpoint tensors per linear, K = in, N = out, g = `group_size` (-1: one group of K):
- `qweight` int32 [K/8, N]: packed along the INPUT dim, nibble j of row r is input row 8 r + j;
- `qzeros` int32 [K/g, N/8]: packed along the output dim (nibble j = column 8 c + j). The
  "gptq" (v1) format stores zero - 1 (so the reader adds 1); "gptq_v2" stores the zero itself;
- `scales` fp16 [K/g, N];
- `g_idx` int32 [K]: the group of each input row. With `desc_act` (act-order) the rows were
  quantized in a permuted order, so g_idx is not `k // g`.
The weight is `W[k, n] = (q[k, n] - zp[g_idx[k], n]) * s[g_idx[k], n]`. With act-order the
repack sorts the input rows by group and keeps that permutation: `x[:, perm] @ W_sorted`.
"""

from typing import Any

import torch
import torch.nn as nn

from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase)
from minivllm.model_executor.layers.quantization.int4 import (ACT_DTYPES, Int4LinearKernelMixin,
                                                              check_group_size, is_linear_layer,
                                                              set_int4_weights)
from minivllm.model_executor.parameter import (ChannelQuantScaleParameter,
                                              GroupQuantScaleParameter, PackedColumnParameter,
                                              PackedvLLMParameter, RowvLLMParameter,
                                              register_weight_loader_v2_supported_method)

SUPPORTED_BITS = (4,)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
# checkpoint_format -> what the reader adds to a stored zero point
_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
_NOT_GPTQ = ("This checkpoint is not a GPTQ checkpoint (config.json has no GPTQ "
             "quantization_config and there is no quantize_config.json); to quantize an "
             "unquantized checkpoint online pass --quantization int4 (or fp8 / int8)")


class GPTQConfig(QuantizationConfig):
    """GPTQ: 4-bit weights packed along the input dim, group scales and zeros, act-order."""

    def __init__(self, weight_bits: int, group_size: int, desc_act: bool, sym: bool = True,
                 lm_head_quantized: bool = False, checkpoint_format: str = "gptq") -> None:
        super().__init__()
        if weight_bits not in SUPPORTED_BITS:
            raise ValueError(f"GPTQ with {weight_bits}-bit weights is not supported; supported "
                             f"bits: {', '.join(map(str, SUPPORTED_BITS))}")
        check_group_size("GPTQ", group_size, SUPPORTED_GROUP_SIZES)
        if checkpoint_format not in _ZERO_OFFSETS:
            raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; "
                             f"supported: {', '.join(_ZERO_OFFSETS)}")
        if lm_head_quantized:
            raise NotImplementedError("GPTQ checkpoints with a quantized lm_head (lm_head: true) "
                                      "are not supported; the LM head must be unquantized")
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.lm_head_quantized = lm_head_quantized
        self.checkpoint_format = checkpoint_format
        self.pack_factor = 32 // weight_bits

    def __repr__(self) -> str:
        return (f"GPTQConfig(weight_bits={self.weight_bits}, group_size={self.group_size}, "
                f"desc_act={self.desc_act}, sym={self.sym}, "
                f"checkpoint_format={self.checkpoint_format!r})")

    def get_name(self) -> str:
        return "gptq"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return list(ACT_DTYPES)

    @classmethod
    def get_min_capability(cls) -> int:
        return 60   # vLLM's; minivllm's CUDA path is plain PyTorch

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        method = str(config.get("quant_method", "gptq")).lower()
        if not config or method != "gptq":
            raise ValueError(_NOT_GPTQ)
        if cls.get_from_keys_or(config, ["dynamic"], None):
            raise NotImplementedError("GPTQ per-module overrides (`dynamic`) are not supported")
        return cls(weight_bits=cls.get_from_keys(config, ["bits"]),
                   group_size=cls.get_from_keys(config, ["group_size"]),
                   desc_act=cls.get_from_keys(config, ["desc_act"]),
                   sym=cls.get_from_keys_or(config, ["sym"], True),
                   lm_head_quantized=cls.get_from_keys_or(config, ["lm_head"], False),
                   checkpoint_format=str(cls.get_from_keys_or(
                       config, ["checkpoint_format"], "gptq")).lower())

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return GPTQLinearMethod(self) if is_linear_layer(layer) else None


@register_weight_loader_v2_supported_method
class GPTQLinearMethod(Int4LinearKernelMixin, QuantizeMethodBase):
    """Loads `qweight` / `qzeros` / `scales` / `g_idx`, then repacks them for the int4 kernel."""

    def __init__(self, quant_config: GPTQConfig) -> None:
        self.quant_config = quant_config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        config, pack = self.quant_config, self.quant_config.pack_factor
        group_size = config.group_size if config.group_size != -1 else input_size_per_partition
        row_sharded = input_size != input_size_per_partition
        if input_size_per_partition % group_size != 0 or input_size_per_partition % pack != 0:
            raise ValueError(f"The input size {input_size_per_partition} is not a multiple of "
                             f"the GPTQ group size {group_size} (too large a tensor-parallel "
                             "size?)")
        if any(size % pack != 0 for size in output_partition_sizes):
            raise ValueError(f"The output sizes {output_partition_sizes} are not multiples of "
                             f"GPTQ's pack factor {pack} (too large a tensor-parallel size?)")
        if config.desc_act and row_sharded and config.group_size != -1:
            # Each rank would hold input rows of every group: the groups are not contiguous.
            raise NotImplementedError("GPTQ act-order (desc_act: true) checkpoints cannot be "
                                      "split by input rows; use tensor_parallel_size 1")
        out = sum(output_partition_sizes)
        weight_loader = extra_weight_attrs["weight_loader"]
        layer.register_parameter("qweight", PackedvLLMParameter(
            data=torch.empty(input_size_per_partition // pack, out, dtype=torch.int32),
            input_dim=0, output_dim=1, packed_dim=0, packed_factor=pack,
            weight_loader=weight_loader))
        # Without act-order a checkpoint may omit g_idx: default to contiguous groups.
        g_idx = torch.arange(input_size_per_partition, dtype=torch.int32) // group_size
        layer.register_parameter("g_idx", RowvLLMParameter(
            data=g_idx, input_dim=0, weight_loader=weight_loader))
        _register_scales_and_zeros(layer, input_size_per_partition // group_size, out, pack,
                                   per_channel=config.group_size == -1,
                                   weight_loader=weight_loader)
        layer.gptq_group_size = group_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        offset = _ZERO_OFFSETS[self.quant_config.checkpoint_format]
        codes = unpack_gptq_qweight(layer.qweight.data).t()                 # [N, K]
        zero_points = unpack_gptq_qzeros(layer.qzeros.data).t() + offset    # [N, K/g]
        scales = layer.scales.data.t()                                      # [N, K/g]
        group_size = layer.gptq_group_size
        # Without act-order g_idx is `k // g` by definition (and holds global group numbers on a
        # row-parallel rank): only act-order checkpoints are read for a permutation.
        perm = _input_order(layer.g_idx.data, group_size) if self.quant_config.desc_act else None
        if perm is not None:
            codes = codes.index_select(1, perm)     # input rows sorted by group
        set_int4_weights(layer, codes, scales, zero_points, group_size, layer.params_dtype,
                         perm)


def unpack_gptq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] packed along the input dim -> uint8 codes [K, N]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    nibbles = (qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15   # [K/8, 8, N]
    return nibbles.to(torch.uint8).reshape(-1, qweight.shape[1])


def unpack_gptq_qzeros(qzeros: torch.Tensor) -> torch.Tensor:
    """int32 [G, N/8] packed along the output dim (sequential nibbles) -> int32 [G, N]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qzeros.device)
    return ((qzeros.unsqueeze(-1) >> shifts) & 15).reshape(qzeros.shape[0], -1)


def _register_scales_and_zeros(layer: nn.Module, num_groups: int, out: int, pack: int, *,
                               per_channel: bool, weight_loader: Any) -> None:
    # fp32, not params_dtype: keeps the checkpoint's fp16 scales exact until the repack.
    scales = torch.empty(num_groups, out, dtype=torch.float32)
    qzeros = torch.empty(num_groups, out // pack, dtype=torch.int32)
    if per_channel:
        # One group over the whole input: a row-parallel rank loads the [1, N] tensors whole.
        layer.register_parameter("scales", ChannelQuantScaleParameter(
            data=scales, output_dim=1, weight_loader=weight_loader))
        layer.register_parameter("qzeros", PackedColumnParameter(
            data=qzeros, output_dim=1, packed_dim=1, packed_factor=pack,
            weight_loader=weight_loader))
        return
    layer.register_parameter("scales", GroupQuantScaleParameter(
        data=scales, input_dim=0, output_dim=1, weight_loader=weight_loader))
    layer.register_parameter("qzeros", PackedvLLMParameter(
        data=qzeros, input_dim=0, output_dim=1, packed_dim=1, packed_factor=pack,
        weight_loader=weight_loader))


def _input_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The permutation that sorts the input rows by group (None: already in order).

    The kernel needs every group as `group_size` contiguous rows; act-order g_idx satisfies this
    once sorted (each group still has `group_size` members).
    """
    g_idx = g_idx.long()
    num_in = g_idx.numel()
    if torch.equal(g_idx, torch.arange(num_in, device=g_idx.device) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=num_in // group_size)
    if counts.numel() != num_in // group_size or bool((counts != group_size).any()):
        raise ValueError(f"GPTQ g_idx does not give every one of the {num_in // group_size} "
                         f"groups {group_size} input rows; this checkpoint is malformed")
    return torch.argsort(g_idx, stable=True)
