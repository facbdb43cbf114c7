"""Quantization: config base class, per-layer methods, the unquantized defaults, the method registry.

Each method lives in its own module, imported on first use (`get_quantization_config`), so a run
without quantization never loads fp8 / int4 / GGUF code.
"""

import importlib

from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase,
                                                                     is_layer_skipped,
                                                                     method_has_implemented_embedding,
                                                                     resolve_quant_method)
from minivllm.model_executor.layers.quantization.unquantized import (UnquantizedEmbeddingMethod,
                                                                     UnquantizedLinearMethod)

# `--quantization` name -> "module:Class" under this package. A checkpoint's
# `quantization_config.quant_method` (or a .gguf file) picks one; for an unquantized checkpoint
# fp8 / int8 / int4 quantize the weights online, after loading.
_METHODS: dict[str, str] = {
    "gguf": "gguf:GGUFConfig",
    "fp8": "fp8:Fp8Config",
    "compressed-tensors": "compressed_tensors:CompressedTensorsConfig",
    "awq": "awq:AWQConfig",
    "gptq": "gptq:GPTQConfig",
    "int8": "int8:Int8Config",
    "int4": "int4:Int4Config",
}
QUANTIZATION_METHODS: list[str] = list(_METHODS)


def get_quantization_config(quantization: str) -> type[QuantizationConfig]:
    """The QuantizationConfig class registered as `quantization` (ValueError naming the known)."""
    if quantization not in _METHODS:
        raise ValueError(f"Invalid quantization method {quantization!r}. Available methods: "
                         f"{', '.join(QUANTIZATION_METHODS)} (or 'none')")
    module_name, _, class_name = _METHODS[quantization].partition(":")
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name)


__all__ = [
    "QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase",
    "UnquantizedEmbeddingMethod", "UnquantizedLinearMethod", "get_quantization_config",
    "is_layer_skipped", "method_has_implemented_embedding", "resolve_quant_method",
]
