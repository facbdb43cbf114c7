"""Model-side fusion hooks (activation + quantization of the next linear's input), vLLM's path."""

from minivllm.model_executor.layers.fusion.fused_act_quant import (QuantizedActivation,
                                                                   get_input_quant_key,
                                                                   maybe_fused_act_quant)

__all__ = ["QuantizedActivation", "get_input_quant_key", "maybe_fused_act_quant"]
