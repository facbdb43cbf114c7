"""Config classes for checkpoints transformers has no class for, or reads otherwise than vLLM
(vLLM's `transformers_utils.configs`),
and `CONFIG_REGISTRY`: the `model_type` of a config.json -> the class that reads it."""

from minivllm.transformers_utils.configs.dory import DoryConfig
from minivllm.transformers_utils.configs.falcon import RWConfig

# Dory: transformers knows the type but folds its block layout, vLLM's class keeps it (as vLLM).
CONFIG_REGISTRY: dict[str, type] = {"RefinedWeb": RWConfig, "RefinedWebModel": RWConfig,
                                    "dory": DoryConfig}

__all__ = ["CONFIG_REGISTRY", "DoryConfig", "RWConfig"]
