"""Model files and their helpers; `ModelRegistry` and the interface names load on first access."""

import importlib
from typing import Any

_INTERFACES = ("SupportsEagle", "SupportsEagle3", "SupportsLoRA", "SupportsMultiModal", "SupportsPP",
               "SupportsQuant", "supports_eagle", "supports_eagle3", "supports_lora",
               "supports_multimodal", "supports_pp", "supports_quant", "is_text_generation_model")
_INTERFACES_BASE = ("is_pooling_model", "is_vllm_model")

__all__ = ["ModelRegistry", *_INTERFACES, *_INTERFACES_BASE]


def __getattr__(name: str) -> Any:
    # Lazy, so importing a model file (e.g. `...models.llama`) does not import the registry.
    if name == "ModelRegistry":
        module = "minivllm.model_executor.models.registry"
    elif name in _INTERFACES:
        module = "minivllm.model_executor.models.interfaces"
    elif name in _INTERFACES_BASE:
        module = "minivllm.model_executor.models.interfaces_base"
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
