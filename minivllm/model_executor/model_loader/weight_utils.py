"""vLLM's home of `default_weight_loader` (it lives in `parameter.py`) and of `get_quant_config`."""

import json
import os
from typing import Any

from minivllm.config import LoadConfig, ModelConfig
from minivllm.model_executor.layers.quantization import (QuantizationConfig,
                                                         get_quantization_config)
from minivllm.model_executor.parameter import default_weight_loader

__all__ = ["default_weight_loader", "get_quant_config"]


def get_quant_config(model_config: ModelConfig, load_config: LoadConfig,
                     device: str = "cpu") -> QuantizationConfig | None:
    """The QuantizationConfig the model's layers get (None: unquantized).

    Read from, in order: the GGUF file (types per tensor, nothing to parse here), config.json's
    `quantization_config`, a method-specific file in the checkpoint folder
    (`get_config_filenames`, e.g. `quantize_config.json`); otherwise the method quantizes an
    unquantized checkpoint online (`from_config({})`; methods that cannot raise). Then the method
    checks it can run on `device` with the model's activation dtype.
    """
    if model_config.quantization is None:
        return None
    quant_cls = get_quantization_config(model_config.quantization)
    if model_config.is_gguf:
        quant_config = quant_cls.from_config({})
    else:
        quant_config = quant_cls.from_config(_checkpoint_quant_dict(model_config, quant_cls))
    quant_config.verify_runtime(device, model_config.dtype)
    return quant_config


def _checkpoint_quant_dict(model_config: ModelConfig,
                           quant_cls: type[QuantizationConfig]) -> dict[str, Any]:
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    if hf_quant is not None:
        return dict(hf_quant) if isinstance(hf_quant, dict) else hf_quant.to_dict()
    folder = model_config.model
    for name in quant_cls.get_config_filenames():
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return {}   # an unquantized checkpoint: online quantization
