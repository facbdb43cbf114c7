"""Configuration dataclasses (`VllmConfig` and its parts) and the current-config context."""

from minivllm.config.cache import CacheConfig
from minivllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from minivllm.config.load import DeviceConfig, LoadConfig
from minivllm.config.lora import LoRAConfig
from minivllm.config.model import ModelConfig, default_model_path, str_dtype_to_torch_dtype
from minivllm.config.parallel import ParallelConfig
from minivllm.config.pooler import PoolerConfig
from minivllm.config.scheduler import SchedulerConfig
from minivllm.config.speculative import SpeculativeConfig
from minivllm.config.structured_outputs import StructuredOutputsConfig
from minivllm.config.vllm import (VllmConfig, get_cached_compilation_config,
                                  get_current_vllm_config, get_current_vllm_config_or_none,
                                  set_current_vllm_config, valid_tp_sizes)

__all__ = [
    "CacheConfig", "CompilationConfig", "CompilationMode", "CUDAGraphMode", "DeviceConfig",
    "LoadConfig", "LoRAConfig", "ModelConfig", "ParallelConfig", "PoolerConfig", "SchedulerConfig",
    "SpeculativeConfig", "StructuredOutputsConfig", "VllmConfig",
    "default_model_path", "get_cached_compilation_config", "get_current_vllm_config",
    "get_current_vllm_config_or_none", "set_current_vllm_config", "str_dtype_to_torch_dtype",
    "valid_tp_sizes",
]
