"""vLLM's path for `default_weight_loader` (model files import it here); it lives in `parameter.py`."""

from minivllm.model_executor.parameter import default_weight_loader

__all__ = ["default_weight_loader"]
