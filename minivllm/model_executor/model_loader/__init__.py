"""Model loading: build a model from its config and fill it from a checkpoint."""

from minivllm.model_executor.model_loader.default_loader import (BaseModelLoader, DefaultModelLoader,
                                                                 DummyModelLoader, get_model,
                                                                 get_model_loader)
from minivllm.model_executor.model_loader.utils import initialize_model, set_default_torch_dtype

__all__ = ["BaseModelLoader", "DefaultModelLoader", "DummyModelLoader", "get_model", "get_model_loader",
           "initialize_model", "set_default_torch_dtype"]
