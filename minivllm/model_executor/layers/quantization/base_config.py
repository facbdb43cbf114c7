"""QuantizationConfig and QuantizeMethodBase: the hooks layers call to create and apply weights."""

import inspect
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn as nn


class QuantizeMethodBase(ABC):
    """How one layer's weights are created, post-processed and applied."""

    requires_device_loading: bool = True
    uses_meta_device: bool = False
    supports_pre_processed_weights: bool = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, *weight_args: Any, **extra_weight_attrs: Any) -> None:
        """Register the layer's parameters (with their `weight_loader`s)."""

    @abstractmethod
    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer's matmul with the (possibly quantized) weights."""

    def embedding(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Embedding lookup; only methods usable by VocabParallelEmbedding override it."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack loaded weights for the kernel; nothing to do by default."""

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        """Make `layer` share the embedding's Parameter (the same object) and return it."""
        layer.weight = embed_tokens.weight
        return layer

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} cannot dequantize its weights")


def method_has_implemented_embedding(method_class: type[QuantizeMethodBase]) -> bool:
    """True when `method_class` overrides `QuantizeMethodBase.embedding`."""
    base = inspect.getattr_static(QuantizeMethodBase, "embedding")
    return inspect.getattr_static(method_class, "embedding", None) is not base


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme; hands each layer its `QuantizeMethodBase`."""

    # KV-cache scale tensors that may appear in checkpoints without a matching parameter.
    _ignore_unexpected_suffixes: tuple[str, ...] = (
        ".q_scale", ".k_scale", ".v_scale", ".q_zero_point", ".k_zero_point", ".v_zero_point")

    def __init__(self) -> None:
        super().__init__()
        # fused module name -> shard names, e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        self.packed_modules_mapping: dict[str, list[str]] = {}
        self.online_quantization_config: Any = None

    @abstractmethod
    def get_name(self) -> str: ...

    @abstractmethod
    def get_supported_act_dtypes(self) -> list[torch.dtype]: ...

    @classmethod
    @abstractmethod
    def get_min_capability(cls) -> int: ...

    @staticmethod
    @abstractmethod
    def get_config_filenames() -> list[str]: ...

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig": ...

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None: ...

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        return None

    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: list[str]) -> Any:
        for key in keys:
            if key in config:
                return config[key]
        raise ValueError(f"Cannot find any of {keys} in the model's quantization config.")

    @staticmethod
    def get_from_keys_or(config: dict[str, Any], keys: list[str], default: Any) -> Any:
        try:
            return QuantizationConfig.get_from_keys(config, keys)
        except ValueError:
            return default

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        """Rename checkpoint-side module names (none in the unquantized schemes)."""

    def maybe_update_config(self, model_name: str, hf_config: Any = None,
                            revision: str | None = None) -> None:
        """Read extra files of the checkpoint (none needed by the schemes minivllm knows)."""

    @staticmethod
    def get_cache_scale_mapper() -> Any:
        """KV-scale renames (a WeightsMapper); None until a quantized scheme needs them."""
        return None

    @staticmethod
    def get_checkpoint_weight_mapper() -> Any:
        """Checkpoint names to drop or rename (a WeightsMapper); None for now."""
        return None

    def verify_runtime(self, device: str, act_dtype: torch.dtype) -> None:
        """Fail before the model is built when this method cannot run here: the activation dtype
        (`--dtype`) and, on CUDA, the GPU's compute capability. Methods with CPU-feature needs
        extend this and name the method that would run instead."""
        supported = self.get_supported_act_dtypes()
        if act_dtype not in supported:
            names = ", ".join(str(d).removeprefix("torch.") for d in supported)
            raise ValueError(f"Quantization method {self.get_name()!r} runs with activations in "
                             f"{names}, not {str(act_dtype).removeprefix('torch.')}; pass "
                             f"--dtype {names.split(', ')[0]}")
        if device == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if major * 10 + minor < self.get_min_capability():
                raise ValueError(f"Quantization method {self.get_name()!r} needs GPU compute "
                                 f"capability >= {self.get_min_capability()}, this GPU has "
                                 f"{major * 10 + minor}")


def resolve_quant_method(quant_config: QuantizationConfig, layer: nn.Module,
                         prefix: str) -> QuantizeMethodBase | None:
    """The checkpoint's method for `layer` (online re-quantization is not supported)."""
    if getattr(quant_config, "online_quantization_config", None) is not None:
        raise NotImplementedError("Online quantization is not supported in minivllm")
    return quant_config.get_quant_method(layer, prefix=prefix)


_MATCH_MODES = ("exact", "substring", "suffix")


def is_layer_skipped(prefix: str, ignored_layers: list[str],
                     fused_mapping: dict[str, list[str]] = {},  # noqa: B006 (vLLM's signature)
                     *, match_mode: str = "exact") -> bool:
    """Whether `prefix` is left unquantized; all shards of a fused layer must agree."""
    if match_mode not in _MATCH_MODES:
        raise ValueError(f"match_mode must be one of {_MATCH_MODES}, got {match_mode!r}")

    def matches(name: str) -> bool:
        if match_mode == "exact":
            return name in ignored_layers
        if match_mode == "substring":
            return any(ignored in name for ignored in ignored_layers)
        return any(name.endswith(ignored) for ignored in ignored_layers)

    proj_name = prefix.split(".")[-1]
    if proj_name not in fused_mapping or matches(prefix):
        return matches(prefix)
    shard_prefixes = [prefix.replace(proj_name, shard) for shard in fused_mapping[proj_name]]
    skipped = {matches(p) for p in shard_prefixes}
    if len(skipped) > 1:
        listed = ", ".join(f"{p} ({'skipped' if matches(p) else 'quantized'})"
                           for p in shard_prefixes)
        raise ValueError(f"Detected some but not all shards of {prefix} are quantized: {listed}. "
                         "All shards of a fused layer must have the same precision.")
    return skipped.pop()
