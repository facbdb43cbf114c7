"""compressed-tensors checkpoints (llm-compressor): `quant_method: "compressed-tensors"`.

The config's `config_groups` map `targets` ("Linear", a layer name, or "re:<regex>") to a
`weights` / `input_activations` pair; the first group whose target matches a layer picks its
scheme (`compressed_tensors_schemes.py`: fp8 W8A8 / W8A16, int8 W8A8 / W8A16). `ignore` lists
layers (names or "re:" regexes) left unquantized; the shards of a fused layer must agree.
"""

import re
from typing import Any

import torch
import torch.nn as nn

from minivllm.model_executor.layers.linear import LinearBase
from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase)
from minivllm.model_executor.layers.quantization.compressed_tensors_schemes import (
    CompressedTensorsScheme, QuantArgs, get_scheme)
from minivllm.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from minivllm.model_executor.parameter import register_weight_loader_v2_supported_method

SUPPORTED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


class CompressedTensorsConfig(QuantizationConfig):
    """A parsed compressed-tensors `quantization_config`."""

    def __init__(self, target_scheme_map: dict[str, tuple[QuantArgs, QuantArgs | None]],
                 ignore: list[str], quant_format: str,
                 kv_cache_scheme: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.target_scheme_map = target_scheme_map
        self.ignore = list(ignore)
        self.quant_format = quant_format
        self.kv_cache_scheme = kv_cache_scheme

    def get_name(self) -> str:
        return "compressed-tensors"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # fp8 values need bf16 / fp16 activations (as vLLM); int8 kernels also run in fp32
        if any(w.type == "float" for w, _ in self.target_scheme_map.values()):
            return [torch.bfloat16, torch.half]
        return [torch.bfloat16, torch.half, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        quant_format = config.get("format", "")
        if quant_format not in SUPPORTED_FORMATS:
            raise ValueError(f"Unsupported compressed-tensors format {quant_format!r} (int4 "
                             "'pack-quantized' is not supported here); supported formats: "
                             f"{', '.join(SUPPORTED_FORMATS)}")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("A compressed-tensors config needs config_groups")
        target_scheme_map = {}
        for name, group in groups.items():
            if group.get("weights") is None:
                raise ValueError(f"compressed-tensors group {name!r} has no weights entry")
            weights = QuantArgs.from_dict(group["weights"])
            acts = group.get("input_activations")
            acts = QuantArgs.from_dict(acts) if acts else None
            get_scheme(weights, acts)          # fail at config time on unsupported schemes
            for target in group.get("targets", []):
                target_scheme_map[target] = (weights, acts)
        return cls(target_scheme_map, config.get("ignore") or [], quant_format,
                   config.get("kv_cache_scheme"))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        if self._is_ignored(prefix):
            return UnquantizedLinearMethod()
        match = self._find_scheme(prefix)
        if match is None:
            return UnquantizedLinearMethod()   # no group targets this layer
        return CompressedTensorsLinearMethod(get_scheme(*match))

    def _shard_prefixes(self, prefix: str) -> list[str]:
        proj = prefix.rsplit(".", 1)[-1]
        shards = self.packed_modules_mapping.get(proj)
        return [prefix[: -len(proj)] + s for s in shards] if shards else [prefix]

    def _is_ignored(self, prefix: str) -> bool:
        if _matches(prefix, self.ignore):
            return True
        shards = self._shard_prefixes(prefix)
        ignored = [_matches(s, self.ignore) for s in shards]
        if len(set(ignored)) > 1:
            listed = ", ".join(f"{s} ({'ignored' if i else 'quantized'})"
                               for s, i in zip(shards, ignored))
            raise ValueError(f"Detected some but not all shards of {prefix} are quantized: "
                             f"{listed}. All shards of a fused layer must have the same precision.")
        return ignored[0]

    def _find_scheme(self, prefix: str) -> tuple[QuantArgs, QuantArgs | None] | None:
        shards = self._shard_prefixes(prefix)
        for target, scheme in self.target_scheme_map.items():
            if target == "Linear" or _matches(prefix, [target]) or \
                    all(_matches(s, [target]) for s in shards):
                return scheme
        return None


def _matches(name: str, patterns: list[str]) -> bool:
    """An exact module name, or "re:<regex>" matched at the start of the name (as vLLM)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name:
            return True
    return False


@register_weight_loader_v2_supported_method
class CompressedTensorsLinearMethod(QuantizeMethodBase):
    """Hands each hook to the layer's scheme."""

    def __init__(self, scheme: CompressedTensorsScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        layer.scheme = self.scheme
        self.scheme.create_weights(layer, output_partition_sizes, input_size_per_partition,
                                   extra_weight_attrs["weight_loader"])

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.scheme.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheme.apply_weights(layer, x, bias)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        weight = layer.weight.data.float()
        scale = layer.weight_scale.data
        if self.scheme.weights.strategy == "block":
            bn, bk = layer.weight_block_size
            scale = scale.repeat_interleave(bn, 0)[:weight.shape[0]]
            return weight * scale.repeat_interleave(bk, 1)[:, :weight.shape[1]]
        return weight * scale.reshape(-1, 1)
