"""Quantization hooks: config base class, per-layer methods, and the unquantized defaults."""

from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase,
                                                                     is_layer_skipped,
                                                                     method_has_implemented_embedding,
                                                                     resolve_quant_method)
from minivllm.model_executor.layers.quantization.unquantized import (UnquantizedEmbeddingMethod,
                                                                     UnquantizedLinearMethod)

# Names accepted by `--quantization`; minivllm ships no quantized kernels yet.
QUANTIZATION_METHODS: list[str] = []


def get_quantization_config(quantization: str) -> type[QuantizationConfig]:
    raise ValueError(f"Invalid quantization method {quantization!r}. "
                     f"Available methods: {QUANTIZATION_METHODS or 'none'}")


__all__ = [
    "QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase",
    "UnquantizedEmbeddingMethod", "UnquantizedLinearMethod", "get_quantization_config",
    "is_layer_skipped", "method_has_implemented_embedding", "resolve_quant_method",
]
