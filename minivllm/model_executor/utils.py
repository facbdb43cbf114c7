"""vLLM's path for `set_weight_attrs` (it lives in `parameter.py`)."""

from minivllm.model_executor.parameter import set_weight_attrs

__all__ = ["set_weight_attrs"]
