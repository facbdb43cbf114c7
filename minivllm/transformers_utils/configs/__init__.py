"""Config classes for checkpoints transformers has no class for (vLLM's `transformers_utils.configs`),
and `CONFIG_REGISTRY`: the `model_type` of a config.json -> the class that reads it."""

from minivllm.transformers_utils.configs.falcon import RWConfig

CONFIG_REGISTRY: dict[str, type] = {"RefinedWeb": RWConfig, "RefinedWebModel": RWConfig}

__all__ = ["CONFIG_REGISTRY", "RWConfig"]
