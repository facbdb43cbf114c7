"""Model construction: resolve the class, build it under the current config, finish after loading."""

import inspect
import warnings
from typing import Any

import torch
import torch.nn as nn

from minivllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from minivllm.logger import init_logger
from minivllm.model_executor.models.interfaces import supports_quant
from minivllm.model_executor.model_loader.weight_utils import get_quant_config
from minivllm.model_executor.models.registry import ModelRegistry
from minivllm.utils.torch_utils import set_default_torch_dtype

logger = init_logger(__name__)

# Keyword arguments that pre-`vllm_config` model constructors took (guessed for old classes).
_OLD_STYLE_KWARGS = ("config", "cache_config", "quant_config", "lora_config", "scheduler_config")


def get_model_architecture(model_config: ModelConfig) -> tuple[type[nn.Module], str]:
    """The registered class for the config's `architectures` (raises listing supported ones)."""
    return ModelRegistry.resolve_model_cls(model_config.architectures, model_config)


def initialize_model(vllm_config: VllmConfig, *, prefix: str = "", model_class: type[nn.Module] | None = None,
                     model_config: ModelConfig | None = None) -> nn.Module:
    """Build the model (no weights) with the current config, default dtype and device set."""
    model_config = model_config or vllm_config.model_config
    if model_class is None:
        model_class, _ = get_model_architecture(model_config)
    if vllm_config.quant_config is None and model_config.quantization is not None:
        # A VllmConfig assembled by hand (EngineArgs fills this in itself).
        vllm_config.quant_config = get_quant_config(model_config, vllm_config.load_config,
                                                    vllm_config.device_config.device)
    if vllm_config.quant_config is not None:
        _configure_quant_config(vllm_config.quant_config, model_class)
    device = torch.device(vllm_config.device_config.device)
    with set_current_vllm_config(vllm_config, check_compile=True, prefix=prefix), \
            set_default_torch_dtype(model_config.dtype), torch.device(device):
        params = inspect.signature(model_class.__init__).parameters
        if "vllm_config" in params and "prefix" in params:
            return model_class(vllm_config=vllm_config, prefix=prefix)
        msg = ("vLLM model class should accept `vllm_config` and `prefix` as input arguments. "
               f"{model_class.__name__}.__init__ does not; guessing old-style keyword arguments.")
        warnings.warn(msg, DeprecationWarning, stacklevel=2)
        logger.warning(msg)
        return model_class(**_old_style_kwargs(params, vllm_config, model_config, prefix))


def process_weights_after_loading(model: nn.Module, model_config: ModelConfig,
                                  target_device: torch.device | str | None = None) -> None:
    """Let quant methods, attention layers and the model finish their weights after loading."""
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(module)
        if callable(getattr(module, "update_param_tp_status", None)):
            module.update_param_tp_status()
    for module in model.modules():
        # Attention layers take the activation dtype (KV-cache scales default to 1.0).
        if module is not model and _is_attention_layer(module) and \
                callable(getattr(module, "process_weights_after_loading", None)):
            module.process_weights_after_loading(model_config.dtype)
    if callable(getattr(model, "process_weights_after_loading", None)):
        model.process_weights_after_loading()


def _configure_quant_config(quant_config: Any, model_class: type[nn.Module]) -> None:
    """Non-SupportsQuant classes: hand their name mappings to the quant config here (§6.3)."""
    if supports_quant(model_class):
        return   # SupportsQuant.__new__ does it
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(quant_config, "apply_vllm_mapper"):
        quant_config.apply_vllm_mapper(mapper.get_rename_mapper())
    packed = getattr(model_class, "packed_modules_mapping", None)
    if packed is not None:
        quant_config.packed_modules_mapping = packed


def _old_style_kwargs(params: Any, vllm_config: VllmConfig, model_config: ModelConfig,
                      prefix: str) -> dict[str, Any]:
    values = {"config": model_config.hf_config, "cache_config": vllm_config.cache_config,
              "quant_config": vllm_config.quant_config, "lora_config": vllm_config.lora_config,
              "scheduler_config": vllm_config.scheduler_config, "prefix": prefix}
    return {name: values[name] for name in (*_OLD_STYLE_KWARGS, "prefix") if name in params}


def _is_attention_layer(module: nn.Module) -> bool:
    names = {cls.__name__ for cls in type(module).__mro__}
    return bool(names & {"Attention", "AttentionLayerBase", "EncoderOnlyAttention"})
